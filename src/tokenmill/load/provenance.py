"""Where every row of a batch came from: the store, and each document piece's shard, document
number, token offset and source — the input file and line (or row) the document starts at — so a
loss spike at step 51,234 can be traced to its documents.

    origins = explain_positions(plan, loader.positions(51_234 * loader.global_batch_size))
    origins[0].pieces[0].source   # e.g. "/data/web/a.jsonl:1234" or "/data/b.parquet row 17"

A concat row is the L + 1 tokens [a, a + L] of the store's token stream (inputs and targets), so
it may span several documents; a packed row lists its segments. The source comes from the shard's
``.src`` sidecar and the manifest's ``sources`` and ``source_kinds`` (see ``store.format``), read
when first needed and checked against its checksum; a store made before prepare recorded them (or
whose sidecar is missing or damaged) says "source unknown", never an error.

Only the store's own files are read: an input file or URL the manifest names is printed, never
opened (a crafted manifest must not make ``explain`` send requests, signed with the user's
credentials, to a host it names; an input moved or rewritten since must not change the answer).
A store made before ``source_kinds`` names a file's numbers by its extension (a line of a .jsonl,
a row of a .parquet); a .json's, which its content decided, as ``source kind unknown``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from tokenmill.load import sampler
from tokenmill.base.errors import StoreError
from tokenmill.base.io import read_bytes
from tokenmill.load.plan import BatchPlan, SampleSource
from tokenmill.inputs.records import ORIGIN_KINDS, kind_of_name
from tokenmill.store.format import SOURCE_KINDS, SOURCES, Origins, parse_src

__all__ = ["KIND_UNKNOWN", "Piece", "RowOrigin", "SOURCE_UNKNOWN", "explain_positions",
           "source_name"]

SOURCE_UNKNOWN = "source unknown"  # stores made before prepare records its sources
KIND_UNKNOWN = "source kind unknown"  # a number whose meaning the store does not record


class Piece(NamedTuple):
    """One document's tokens in a row."""

    shard: int  # shard-NNNNN of the store
    document: int  # document number within the store
    shard_document: int  # document number within its shard (the Megatron .idx's index)
    token_offset: int  # offset in the document of the piece's first token
    tokens: int  # tokens of the document in the row (inputs and targets: up to seq_len + 1)
    source: str  # "file:line", "file row N", "file element N" (a .json array), "file #N (source
    #              kind unknown)" (a .json of a store made before kinds were recorded), or
    #              "source unknown"
    file: str | None = None  # the input file, as prepare recorded it (None: not recorded)
    line: int | None = None  # 1-based line (or row, or array element) where the document starts
    kind: str | None = None  # what ``line`` counts: "line", "row", "element" (None: unknown)


class RowOrigin(NamedTuple):
    """Row ``row`` of a batch: global sample ``position``, draw ``draw`` of store ``store``."""

    row: int
    position: int
    store: str
    draw: int
    pieces: tuple[Piece, ...]

    def lines(self) -> list[str]:
        """What ``tokenmill explain`` prints: a line per piece, or one saying the row is all
        padding (a packed row no document reached)."""
        head = f"row {self.row}  sample {self.position:,}  store {self.store}  draw {self.draw:,}  "
        if not self.pieces:
            return [head + "padding only: no document in this row"]
        return [head + f"shard {p.shard}  document {p.document:,} ({p.shard_document:,} in its "
                f"shard)  tokens {p.token_offset:,}+{p.tokens}  {p.source}" for p in self.pieces]


def source_name(file: str, line: int, kind: str | None) -> str:
    """How a document's origin is shown, from what the store records (``kind``: what ``line``
    counts; None: not recorded, then what the file's name says, if it decides) — never from the
    file itself.

    source_name("d/a.jsonl", 12, "line") == "d/a.jsonl:12"
    source_name("d/g.json", 3, "element") == "d/g.json element 3"
    source_name("d/g.json", 3, None) == "d/g.json #3 (source kind unknown)"
    """
    kind = kind or kind_of_name(file)
    if kind == "line":
        return f"{file}:{line}"
    if kind in ("row", "element"):
        return f"{file} {kind} {line}"
    return f"{file} #{line} ({KIND_UNKNOWN})"


class _Sidecars:
    """The ``.src`` of each shard of one store, read on first need (None: not recorded)."""

    def __init__(self, store):
        self.store, self.read = store, {}
        files, kinds = store.manifest.get(SOURCES), store.manifest.get(SOURCE_KINDS)
        self.files = files if isinstance(files, list) else None
        known = isinstance(kinds, list) and self.files is not None and len(kinds) == len(files)
        self.kinds = [k if k in ORIGIN_KINDS else None for k in kinds] if known \
            else [None] * len(self.files or ())

    def origins(self, shard: int) -> Origins | str:
        """Shard ``shard``'s origins, or why they are unknown."""
        if shard not in self.read:
            self.read[shard] = self._load(shard)
        return self.read[shard]

    def _load(self, shard: int) -> Origins | str:
        entry = self.store.manifest["shards"][shard]
        if self.files is None or entry.get("src_xxh3") is None:
            return SOURCE_UNKNOWN
        where = f"{os.fspath(self.store.path)}/{entry['name']}.src"
        try:
            data = (read_bytes(where, self.store.open_args().get("storage_options"))
                    if self.store.url else Path(where).read_bytes())
            if data is None or xxhash.xxh3_64_hexdigest(data) != entry["src_xxh3"]:
                raise StoreError(f"{where}: missing or damaged (checksum mismatch)")
            origins = parse_src(data, where)
        except (OSError, StoreError) as e:
            return f"{SOURCE_UNKNOWN} ({e})"
        if len(origins.lines) != entry["num_documents"] or (
                len(origins.files) and int(origins.files.max()) >= len(self.files)):
            return f"{SOURCE_UNKNOWN} ({where} does not match the manifest)"
        return origins


def _piece(source: SampleSource, sidecars: _Sidecars, doc: int, lo: int, hi: int) -> Piece:
    store = source.store
    shard = int(np.searchsorted(store.shard_doc_starts, doc, side="right")) - 1
    local = doc - int(store.shard_doc_starts[shard])
    start = int(store.doc_spans(np.array([doc]))[0][0])
    head = (shard, doc, local, lo - start, hi - lo)
    origins = sidecars.origins(shard)
    if isinstance(origins, str):
        return Piece(*head, origins)
    fid, line = int(origins.files[local]), int(origins.lines[local])
    file, kind = sidecars.files[fid], sidecars.kinds[fid]
    return Piece(*head, source_name(file, line, kind), file, line, kind or kind_of_name(file))


def _pieces(source: SampleSource, sidecars: _Sidecars, address: int) -> tuple[Piece, ...]:
    if source.packed is not None:
        [(rows, _, local)] = source.packed.locate(np.array([address]))
        p, r = rows.layout, int(local[0])
        segs = range(int(p.row_ptr[r]), int(p.row_ptr[r + 1]))
        return tuple(_piece(source, sidecars, int(p.seg_doc[s]), int(p.seg_start[s]),
                            int(p.seg_start[s] + p.seg_len[s])) for s in segs)
    lo, hi = address, address + source.config.seq_len + 1
    first, last = source.store.docs_at(np.array([lo, hi - 1])).tolist()
    starts, lengths = source.store.doc_spans(np.arange(first, last + 1))
    return tuple(_piece(source, sidecars, d, max(lo, int(s)), min(hi, int(s + n)))
                 for d, s, n in zip(range(first, last + 1), starts.tolist(), lengths.tolist()))


def explain_positions(plan: BatchPlan, positions: np.ndarray) -> list[RowOrigin]:
    """The origin of the sample at each global position, one per row."""
    positions = np.asarray(positions, dtype=np.int64)
    if plan.schedule is None:
        sid, draws = np.zeros(len(positions), np.int64), positions
    else:
        sid, draws = sampler.assign_phased(plan.schedule, positions)
    sidecars = [_Sidecars(source.store) for source in plan.sources]
    out = []
    for row, (p, s, d) in enumerate(zip(positions.tolist(), sid.tolist(), draws.tolist())):
        source = plan.sources[s]
        address = int(source.addresses(np.array([d], dtype=np.int64))[0])
        out.append(RowOrigin(row, p, plan.mixture.names[s], d,
                             _pieces(source, sidecars[s], address)))
    return out
