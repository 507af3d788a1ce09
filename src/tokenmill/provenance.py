"""Where every row of a batch came from: the store, and each document piece's shard, document
number, token offset and source — the input file and line (or row) the document starts at — so a
loss spike at step 51,234 can be traced to its documents.

    origins = explain_positions(plan, loader.positions(51_234 * loader.global_batch_size))
    origins[0].pieces[0].source   # e.g. "/data/web/a.jsonl:1234" or "/data/b.parquet row 17"

A concat row is the L + 1 tokens [a, a + L] of the store's token stream (inputs and targets), so
it may span several documents; a packed row lists its segments. The source comes from the shard's
``.src`` sidecar and the manifest's ``sources`` (see ``store.format``), read when first needed and
checked against its checksum; a store made before prepare recorded them (or whose sidecar is
missing or damaged) says "source unknown", never an error.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from tokenmill import sampler
from tokenmill.errors import StoreError
from tokenmill.io import read_bytes
from tokenmill.plan import BatchPlan, SampleSource
from tokenmill.store.format import SOURCES, Origins, parse_src
from tokenmill.tabular import json_layout

__all__ = ["Piece", "RowOrigin", "SOURCE_UNKNOWN", "explain_positions", "source_name"]

SOURCE_UNKNOWN = "source unknown"  # stores made before prepare records its sources
ROW_FORMATS = (".parquet", ".arrow", ".csv", ".tsv")  # their Doc.line is a row, not a line


class Piece(NamedTuple):
    """One document's tokens in a row."""

    shard: int  # shard-NNNNN of the store
    document: int  # document number within the store
    shard_document: int  # document number within its shard (the Megatron .idx's index)
    token_offset: int  # offset in the document of the piece's first token
    tokens: int  # tokens of the document in the row (inputs and targets: up to seq_len + 1)
    source: str  # "file:line", "file row N", "file element N" (a .json array) or "source unknown"
    file: str | None = None  # the input file, as prepare recorded it (None: not recorded)
    line: int | None = None  # 1-based line (or row: Parquet, Arrow) where the document starts


class RowOrigin(NamedTuple):
    """Row ``row`` of a batch: global sample ``position``, draw ``draw`` of store ``store``."""

    row: int
    position: int
    store: str
    draw: int
    pieces: tuple[Piece, ...]


def source_name(file: str, line: int) -> str:
    """How a document's origin is shown; a .json holding one array numbers its elements.

    source_name("d/a.jsonl", 12) == "d/a.jsonl:12"; source_name("d/b.parquet", 3) == "d/b.parquet row 3"
    """
    if file.lower().endswith(ROW_FORMATS):
        return f"{file} row {line}"
    if file.lower().endswith(".json"):
        return f"{file} element {line}" if _json_array(file) else f"{file}:{line}"
    return f"{file}:{line}"


@functools.lru_cache(maxsize=256)
def _json_array(file: str) -> bool:
    """Whether a .json input holds one array (its .src numbers elements, not lines); a file that
    cannot be read any more is taken for JSON Lines, the common form."""
    try:
        return json_layout(file) == "array"
    except (OSError, ValueError, ImportError):
        return False


class _Sidecars:
    """The ``.src`` of each shard of one store, read on first need (None: not recorded)."""

    def __init__(self, store):
        self.store, self.read = store, {}
        files = store.manifest.get(SOURCES)
        self.files = files if isinstance(files, list) else None

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
    file, line = sidecars.files[int(origins.files[local])], int(origins.lines[local])
    return Piece(*head, source_name(file, line), file, line)


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
