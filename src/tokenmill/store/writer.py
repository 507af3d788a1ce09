"""The one resumable writer of a store: prepare's local engine, its Ray engine and the
streaming cache all write through ``StoreWriter``, which owns an output for one run.

On disk, beside the shards (``store.shards`` writes those), one format for every writer::

    .lock                      flock held while a writer runs (its text: "pid host")
    .progress/key.json         the resume key: settings, unit size, the input files and sizes
    .progress/shard-NNNNN.json shard NNNNN committed: {"shard": its ShardInfo, "cursor": [unit,
                               doc] (where reading resumes), "skipped": skips up to the cursor,
                               "inputs": {unit: xxh3 of that unit's input bytes},
                               "texts": {unit: its documents' texts' sum} (a split only)}
    .progress/shard-NNNNN.pending  shard NNNNN's files may exist, not yet committed
    .progress/units/…          Ray's staged units

Order of writes: ``.pending`` → the shard's files (temp + rename, or upload) → its record →
``.pending`` removed; last the manifest (atomically), then ``.progress`` and ``.lock`` go. A rerun
with the same key keeps the committed shards that verify (checksums; and their inputs, if the
caller checks them) and redoes the rest.

Ownership: the writer deletes or overwrites only files whose names are a store's *and* that a
manifest, record or ``.pending`` in this output names. Anything else is left alone; a
``shard-NNNNN.bin``/``.idx``/``.src`` that nothing here names is refused, by name, never deleted.
A shard's ``.src`` (``WriterConfig.origins``) is written, committed and removed with its pair.

A URL output is staged in a local folder (``.lock`` and ``.progress`` live there) and uploaded
shard by shard; as object stores have no locks, writers on other machines are kept out by a
lease object, ``<url>/.lease.json``, renewed every 30 s and refused while live (see ``Lease``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from tokenmill.inputs import sources
from tokenmill.base.errors import (ConcurrentWriterError, ConfigError, InputError, StoreError,
                                   os_error_text)
from tokenmill.base.io import (atomic_write_json, json_bytes, list_sizes, lock_file, redact,
                               special_kind, unlock, xxh3_file)
from tokenmill.store.format import (MANIFEST, SHARD_EXTS, SHARD_FILE, Origins, build_manifest,
                                    parse_manifest, shard_files, shard_name)
from tokenmill.store.shards import MAX_EXAMPLES, ShardInfo, ShardWriter, SkipLog
from tokenmill.store.upload import LEASE, Lease, RemoteOut, upload_errors

__all__ = ["KEY_FILE", "LEASE", "LOCK", "Lease", "MAX_EXAMPLES", "PROGRESS", "ShardInfo", "ShardWriter", "SkipLog",
           "StoreWriter", "WriterConfig", "describe_change", "take_lock"]

LOCK = ".lock"
PROGRESS = ".progress"
KEY_FILE = "key.json"
RECORD = re.compile(r"(shard-\d{5,})\.(json|pending)")
OUR_TEMP = re.compile(r"\.(?:shard-\d{5,}\.(?:bin|idx|src)|manifest\.json)\.tmp(?:-\d+-[0-9a-f]+)?")
PROGRESS_TEMP = re.compile(r"\.(?:shard-\d{5,}\.json|key\.json)\.tmp-\d+-[0-9a-f]+")


# ---- the output lock ----------------------------------------------------------------------------


def take_lock(directory: Path, where: str) -> int:
    """An fd holding the exclusive ``flock`` on ``directory/.lock``; ConcurrentWriterError naming
    the holder's pid if another process has it."""
    fd = lock_file(directory / LOCK, exclusive=True, wait=False)
    if fd is None:
        holder: list[str] = []
        for _ in range(20):  # the holder writes "pid host" just after taking the lock
            try:
                holder = (directory / LOCK).read_text().split()
            except OSError:
                pass
            if holder:
                break
            time.sleep(0.01)
        pid = int(holder[0]) if holder and holder[0].isdigit() else None
        who = f" (pid {pid}{' on ' + holder[1] if len(holder) > 1 else ''})" if pid else ""
        raise ConcurrentWriterError(
            f"{where}: another tokenmill process{who} is writing this store right now; wait "
            "for it to finish (or stop it), or choose another --out", path=where, pid=pid)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def describe_change(old: dict, new: dict) -> str:
    """What differs between two resume keys (or settings dicts), old → new, in words.

    describe_change({"shard_tokens": 5}, {"shard_tokens": 7}) == "shard_tokens: 5 → 7"
    """
    flat_old = {**old.get("settings", {}), **{k: v for k, v in old.items() if k != "settings"}}
    flat_new = {**new.get("settings", {}), **{k: v for k, v in new.items() if k != "settings"}}
    parts = []
    for k in sorted(set(flat_old) | set(flat_new)):
        a, b = flat_old.get(k), flat_new.get(k)
        if a == b or (k == "files_xxh3" and "files" in flat_old and "files" in flat_new):
            continue
        if k == "files":
            was, now = dict(map(tuple, a or [])), dict(map(tuple, b or []))
            diff = [f"{f}: {was.get(f, 'absent')} → {now.get(f, 'absent')} bytes"
                    for f in sorted(set(was) | set(now)) if was.get(f) != now.get(f)]
            parts.append("input files changed: " + "; ".join(diff[:3]) +
                         (f"; and {len(diff) - 3} more" if len(diff) > 3 else ""))
        elif k == "files_xxh3":
            parts.append("the input files' names or sizes changed")
        else:
            parts.append(f"{k}: {a!r} → {b!r}")
    return redact("; ".join(parts)) or "nothing"


def not_a_folder(out: Path, where: str, error: OSError) -> str:
    """Why the output ``out`` could not be made a folder (``error``), and what to do, in words."""
    if out.is_symlink() and not out.exists():
        return (f"{where}: is a symbolic link to {os.readlink(out)}, which does not exist; the "
                "output must be a folder to write in: create the folder it points to, or choose "
                "another --out")
    what = ("a file" if out.is_file() else special_kind(out.stat().st_mode)
            if out.exists() and not out.is_dir() else None)
    if what is None:
        return f"{os_error_text(error)}; the output must be a folder to write in"
    return (f"{where}: is {what}, not a folder; the output must be a folder to write in: move it "
            "away, or choose another --out")


# ---- the one resumable writer -------------------------------------------------------------------


@dataclass(frozen=True)
class WriterConfig:
    """What decides a StoreWriter's output, and how it treats what it finds there."""

    dtype: str
    shard_tokens: int
    key: dict  # the resume key: a rerun resumes only when it is equal (needs key["settings"])
    overwrite: bool = False
    origins: bool = False  # each shard gets a .src: where its documents came from


class StoreWriter:
    """Owns one output for one run: lock, progress, shards, manifest last (module docstring).

    ``manifest`` is set when the output already holds this very store (nothing to do).
    ``check(record)``: False drops that committed shard and all after it (input changed).
    ``same_inputs(manifest, where)``: raises if a finished store's inputs changed since (asked
    before its settings are compared, which some input changes alter too); not under overwrite.
    """

    def __init__(self, out: str | os.PathLike, config: WriterConfig, *,
                 remote: RemoteOut | None = None, check: Callable[[dict], bool] | None = None,
                 same_inputs: Callable[[dict, str], None] | None = None):
        self.config, self.remote, self.same_inputs = config, remote, same_inputs
        self.out = Path(out)  # the store, or the local staging folder of a URL output
        self.where = redact(remote.url if remote else str(self.out))
        self.pdir = self.out / PROGRESS
        self.shards: list[ShardInfo] = []
        self.cursor: tuple[int, int] = (0, 0)
        self.skips = SkipLog()
        self._pending_skips: list[tuple[int, int, sources.Skip]] = []
        self._digests: dict[int, str] = {}
        self.input_digests: dict[int, str] = {}  # every unit's of the store, committed or not
        self._texts: dict[int, str] = {}
        self.unit_texts: dict[int, str] = {}  # the same, of its documents' texts (note_unit)
        self._writer: ShardWriter | None = None
        self.committed_cursor: tuple[int, int] = (0, 0)
        self.manifest: dict | None = None
        self._lease: Lease | None = None
        self._lock: int | None = None
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock = take_lock(self.out, self.where)
        except OSError as e:
            raise StoreError(redact(not_a_folder(self.out, self.where, e))) from None
        try:
            self._lease = Lease(remote, self.where) if remote is not None else None
            self.manifest = self._existing_store()
            if self.manifest is None:
                self._resume(check)
        except BaseException:
            self.close()
            raise

    # -- what is there ---------------------------------------------------------------------------

    def _records(self) -> tuple[list[dict], set[int]]:
        """The committed records in order (up to the first gap or damage), and pending indexes."""
        records, pending = {}, set()
        for p in self.pdir.iterdir() if self.pdir.is_dir() else ():
            if not (m := RECORD.fullmatch(p.name)):
                continue
            index = int(m[1][6:])
            if m[2] == "pending":
                pending.add(index)
                continue
            try:
                records[index] = json.loads(p.read_text())
                ShardInfo(**records[index]["shard"])
            except (OSError, ValueError, KeyError, TypeError):
                records.pop(index, None)
        ordered = []
        while len(ordered) in records:
            ordered.append(records.pop(len(ordered)))
        pending |= set(records)  # records after a gap: their shards are ours, not committed
        return ordered, pending

    def _listing(self) -> set[str]:
        """Names of the files in the output (remote objects for a URL output), fresh."""
        if self.remote is not None:
            return set(list_sizes(self.remote.url, self.remote.storage_options))
        return {p.name for p in self.out.iterdir()}

    def _refuse_strays(self, ours: set[str]) -> None:
        """Raise if the output holds shard files that nothing of ours names."""
        strays = sorted(n for n in self._listing() if SHARD_FILE.fullmatch(n) and n not in ours)
        if strays:
            them = "them" if len(strays) > 1 else "it"
            more = f" and {len(strays) - 5} more" if len(strays) > 5 else ""
            raise StoreError(
                f"{self.where}: holds {', '.join(strays[:5])}{more}, which no manifest or progress "
                f"record of tokenmill there names, so tokenmill cannot tell that it wrote {them} "
                f"and will not delete or overwrite {them}; move {them} away (or delete {them} "
                "yourself), or choose another --out")

    def _existing_store(self) -> dict | None:
        """The manifest if the output already holds this very store; else None (after removing
        an older store of ours under ``overwrite``)."""
        data = (self.remote.manifest_text() if self.remote else
                (self.out / MANIFEST).read_bytes() if (self.out / MANIFEST).exists() else None)
        records, pending = self._records()
        ours = {f for r in records for f in ShardInfo(**r["shard"]).files()}
        ours |= {f"{shard_name(i)}{e}" for i in pending for e in SHARD_EXTS}
        if data is None:
            self._refuse_strays(ours)
            return None
        try:
            manifest = parse_manifest(data, f"{self.where}/{MANIFEST}")
        except StoreError as e:
            raise StoreError(f"{e}. tokenmill replaces only a store whose manifest it can read: "
                             f"move {MANIFEST} away (or delete it yourself), or choose another "
                             "--out") from None
        listed = {f for s in manifest["shards"] for f in shard_files(s)}
        self._refuse_strays(ours | listed)
        if self.same_inputs is not None and not self.config.overwrite:
            self.same_inputs(manifest, self.where)
        settings = manifest.get("settings")
        if settings == self.config.key["settings"] and not self.config.overwrite:
            self._clear_progress()
            return manifest
        if not self.config.overwrite:
            raise ConfigError(
                f"{self.where}: already holds a store prepared with other settings "
                f"({describe_change(settings or {}, self.config.key['settings'])}); pass "
                "--overwrite to replace it, or choose another --out")
        self._remove([MANIFEST])  # first: the old store now reads as incomplete
        self._remove(sorted(listed))
        return None

    def _resume(self, check: Callable[[dict], bool] | None) -> None:
        """Keep the committed shards that still verify; remove everything else of ours."""
        records, pending = self._records()
        key = self._read_key()
        if key != self.config.key:
            if records and key is not None and not self.config.overwrite:
                advice = ("an input changed since: pass --overwrite to start over" if
                          key.get("files") != self.config.key.get("files") else
                          "rerun the original command to finish it, or pass --overwrite to start over")
                raise ConfigError(f"{self.where}: holds an unfinished prepare with other settings "
                                  f"({describe_change(key, self.config.key)}); {advice}")
            pending |= set(range(len(records)))
            records = []
        kept = 0
        while kept < len(records) and self._intact(records[kept]) and \
                (check is None or check(records[kept])):
            kept += 1
        drop = {i for i in pending if i >= kept} | set(range(kept, len(records)))
        self._remove(sorted(f"{shard_name(i)}{e}" for i in drop for e in SHARD_EXTS))
        for i in sorted(drop | pending):  # a kept shard's marker outlived its record: stale
            for ext in (".json", ".pending") if i >= kept else (".pending",):
                (self.pdir / f"{shard_name(i)}{ext}").unlink(missing_ok=True)
        self._remove_temps()
        self.pdir.mkdir(exist_ok=True)
        if key != self.config.key:
            atomic_write_json(self.pdir / KEY_FILE, self.config.key)
        self.shards = [ShardInfo(**r["shard"]) for r in records[:kept]]
        for r in records[:kept]:
            self.input_digests.update((int(u), d) for u, d in r.get("inputs", {}).items())
            self.unit_texts.update((int(u), d) for u, d in r.get("texts", {}).items())
        if kept:
            self.cursor = tuple(records[kept - 1]["cursor"])
            self.skips = SkipLog.from_json(records[kept - 1]["skipped"])
        self.committed_cursor = self.cursor

    def start_over(self) -> None:
        """Drop every committed shard of this unfinished run and its records: the run starts again
        from its first unit (what it committed is not what it would make now)."""
        self.cursor, self.skips = (0, 0), SkipLog()
        self.input_digests.clear()
        self.unit_texts.clear()
        self._remove_staged()  # Ray's: made as the committed ones were
        self._resume(lambda record: False)

    def _read_key(self) -> dict | None:
        try:
            return json.loads((self.pdir / KEY_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _intact(self, record: dict) -> bool:
        """A committed shard's files are in place with their recorded sizes and checksums (for a
        URL output: their sizes, and the objects are not re-read)."""
        info = ShardInfo(**record["shard"])
        if self.config.origins and info.src_xxh3 is None:
            return False  # an older run's shard, without the .src this run records
        if self.remote is not None:
            return self.remote.has_shard(info)
        for name, size, digest in info.file_sums():
            f = self.out / name
            if not f.is_file() or f.stat().st_size != size or xxh3_file(f) != digest:
                return False
        return True

    # -- removing what is ours ---------------------------------------------------------------------

    def _remove(self, names: Iterable[str]) -> None:
        """Delete these files of ours from the output (and the staging folder of a URL output)."""
        names = list(names)
        for n in names:
            (self.out / n).unlink(missing_ok=True)
        if self.remote is not None and names:
            present = self._listing()
            for n in [n for n in names if n in present]:
                with upload_errors(redact(f"{self.remote.url}/{n}")):
                    self.remote.fs.rm_file(f"{self.remote.root}/{n}")

    def _remove_temps(self) -> None:
        """Temporary files of dead writers (their names are ours alone)."""
        for d, pattern in ((self.out, OUR_TEMP), (self.pdir, PROGRESS_TEMP)):
            for p in d.iterdir() if d.is_dir() else ():
                if pattern.fullmatch(p.name):
                    p.unlink(missing_ok=True)

    def _remove_staged(self) -> Path:
        """Remove the units Ray's engine staged (``.progress/units``, only files of ours); that
        folder."""
        units = self.pdir / "units"
        for p in units.iterdir() if units.is_dir() else ():
            if re.fullmatch(r"unit-\d{7,}\.(?:bin|json)(?:\.tmp-\d+-[0-9a-f]+)?|"
                            r"\.unit-\d{7,}\.(?:bin|json)\.tmp-\d+-[0-9a-f]+", p.name):
                p.unlink(missing_ok=True)
        return units

    def _clear_progress(self) -> None:
        """Remove ``.progress`` (only the files we write there), e.g. once the manifest is in."""
        if not self.pdir.is_dir():
            return
        units = self._remove_staged()
        for p in self.pdir.iterdir():
            if p.name == KEY_FILE or RECORD.fullmatch(p.name) or PROGRESS_TEMP.fullmatch(p.name):
                p.unlink(missing_ok=True)
        for d in (units, self.pdir):
            try:
                d.rmdir()
            except OSError:  # not empty (someone else's file) or gone: leave it
                pass

    # -- writing -----------------------------------------------------------------------------------

    def pend(self, index: int) -> None:
        """Mark shard ``index`` as being written (before any of its files may appear)."""
        (self.pdir / f"{shard_name(index)}.pending").touch()

    def note_unit(self, u: int, d0: int, skips: Iterable[tuple[int, sources.Skip]],
                  digest: str | None = None, texts: str | None = None) -> None:
        """Unit ``u``'s skips (by document ordinal; those before ``d0`` are already counted),
        the xxh3 of its input bytes and ``texts`` (one of its documents' texts, for the run's
        own checks), recorded with the shards that hold its documents."""
        self._pending_skips.extend((u, o, s) for o, s in skips if o >= d0)
        if digest is not None:
            self._digests[u] = self.input_digests[u] = digest
        if texts is not None:
            self._texts[u] = self.unit_texts[u] = texts

    def add(self, u: int, d0: int, tokens: np.ndarray, lengths: np.ndarray,
            skips: Iterable[tuple[int, sources.Skip]] = (), digest: str | None = None,
            origins: Origins | None = None, texts: str | None = None) -> None:
        """Unit ``u``'s documents from its document ``d0`` on (and their ``origins``, in
        lockstep, when ``config.origins``), units in order; documents before the resume cursor
        are dropped (a resumed run re-reads its first unit)."""
        cu, cd = self.cursor
        if u < cu:
            return
        if u == cu and cd > d0:
            tokens, lengths = tokens[int(lengths[:cd - d0].sum()):], lengths[cd - d0:]
            origins, d0 = None if origins is None else origins.part(cd - d0), cd
        if self._writer is None:
            self._writer = ShardWriter(self.out, dtype=np.dtype(self.config.dtype),
                                       shard_tokens=self.config.shard_tokens,
                                       first_shard=len(self.shards), on_start=self.pend,
                                       origins=self.config.origins)
        self.note_unit(u, d0, skips, digest, texts)
        for info, n_docs in self._writer.add(tokens, lengths, origins):
            self.commit(info, (u, d0 + n_docs))
        self.cursor = (u + 1, 0)

    def commit(self, info: ShardInfo, cursor: tuple[int, int], *, in_place: bool = False) -> None:
        """Commit a shard whose files are written: for a URL output, once uploaded from staging
        (``in_place``: the files are already at their final place, as Ray's tasks write them)."""
        keep = []
        for u, o, s in self._pending_skips:  # a skip counts once its place is written
            (self.skips.add(s) if (u, o) < tuple(cursor) else keep.append((u, o, s)))
        self._pending_skips = keep
        first = self.committed_cursor[0]
        inputs, texts = ({str(u): d for u, d in notes.items() if first <= u <= cursor[0]}
                         for notes in (self._digests, self._texts))
        self._digests = {u: d for u, d in self._digests.items() if u >= cursor[0]}
        self._texts = {u: d for u, d in self._texts.items() if u >= cursor[0]}
        record = {"shard": info.to_json(), "cursor": list(cursor), "skipped": self.skips.to_json(),
                  "inputs": inputs} | ({"texts": texts} if texts else {})
        self.shards.append(info)
        self.committed_cursor = tuple(cursor)
        path = self.pdir / f"{info.name}.json"

        def write() -> None:
            """Commit: the record, then the shard's pending marker goes."""
            atomic_write_json(path, record)
            (self.pdir / f"{info.name}.pending").unlink(missing_ok=True)
        if self.remote is not None and not in_place:
            self.remote.submit(self.out, info, on_uploaded=write)
        else:
            write()

    def finish(self, tokenizer: dict, settings: dict, extra: dict | None = None) -> dict:
        """Close the last shard, write the manifest (last, atomically) and release the output;
        ``extra``: informative manifest fields (see ``format.build_manifest``)."""
        if self._writer is not None and (info := self._writer.finish()) is not None:
            self.commit(info, self.cursor)
        for _, _, s in self._pending_skips:
            self.skips.add(s)
        self._pending_skips = []
        if self.remote is not None:
            self.remote.drain()
        if not self.shards:
            raise InputError(f"no documents found in {settings.get('num_files', 'the')} input "
                             f"file(s) (skipped: {self.skips.reasons()})")
        manifest = build_manifest(tokenizer=tokenizer, dtype=np.dtype(self.config.dtype),
                                  shards=self.shards, settings=settings,
                                  skipped=self.skips.to_json(), extra=extra)
        if self.remote is not None:
            self.remote.write_manifest(json_bytes(manifest))
        else:
            atomic_write_json(self.out / MANIFEST, manifest)
        self._clear_progress()
        self.manifest = manifest
        self.close()
        return manifest

    def abort(self) -> None:
        """Stop writing: drop the open shard's temporary files and queued uploads."""
        if self._writer is not None:
            self._writer.abort()
        if self.remote is not None:
            self.remote.abort()
        self.close()

    def close(self) -> None:
        """Release the output (the lock file goes too); idempotent."""
        if self._lock is None:
            return
        lock, self._lock = self._lock, None
        if self._lease is not None:
            self._lease.release()
        (self.out / LOCK).unlink(missing_ok=True)  # still held: a waiter re-checks the inode
        if self.remote is not None:  # a URL output: its local staging folder, once of no use
            for p in self.out.iterdir() if self.manifest is not None else ():
                if SHARD_FILE.fullmatch(p.name) or OUR_TEMP.fullmatch(p.name):
                    p.unlink(missing_ok=True)
            try:
                self.out.rmdir()
            except OSError:  # it holds an unfinished run's progress
                pass
        unlock(lock)
