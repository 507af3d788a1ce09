"""Columnar readers behind ``tokenmill.inputs.sources``: parquet files and Arrow IPC streams.

A parquet file is cut by row groups, an Arrow IPC *stream* (the ``data-*.arrow`` files of a
Hugging Face dataset saved with ``save_to_disk``) by record batches: consecutive groups (their
whole size) or batches (their text column) until they reach ``unit_bytes``. A local stream is
memory-mapped (``pa.memory_map`` + ``pa.ipc.open_stream``), so passing over the batches before a
range copies nothing; a remote one is a single unit. Rows are numbered from 1 within the file:
a document is ``Doc(text, row)``.

Every reader takes a ``report(where, reason, detail)`` function and yields what it returns in the
place of a bad record (a ``Skip``, or it raises).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

from tokenmill.base.errors import require
from tokenmill.base.io import is_url, open_binary
from tokenmill.inputs.records import Doc, Record, Report, Skip, SourceConfig


def plan_parquet(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Ranges of consecutive row groups, grouped until their uncompressed size reaches unit_bytes.

    Row-group sizes only: pyarrow's per-column metadata accessor (``row_group(g).column(c)``)
    aborts the whole process on some damaged footers (a C++ exception it does not catch).
    """
    with _parquet(path, config.storage_options) as pf:
        md = pf.metadata
        sizes = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
    return group(sizes, config.unit_bytes)


def plan_arrow(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Ranges of consecutive record batches of an Arrow stream (a remote stream: one range)."""
    if is_url(path):
        return [(0, -1)]
    with _arrow_stream(path, None) as reader:
        has_key = reader.schema.get_field_index(config.text_key) >= 0
        sizes = [(b.column(config.text_key) if has_key else b).get_total_buffer_size()
                 for b in reader]
    return group(sizes, config.unit_bytes)


def group(sizes: list[int], unit_bytes: int) -> list[tuple[int, int]]:
    """Consecutive parts grouped until they reach unit_bytes.

    group([5, 1, 9, 2], 6) == [(0, 2), (2, 3), (3, 4)]
    """
    ranges, first, acc = [], 0, 0
    for g, size in enumerate(sizes):
        acc += size
        if acc >= unit_bytes:
            ranges.append((first, g + 1))
            first, acc = g + 1, 0
    if first < len(sizes) or not ranges:
        ranges.append((first, len(sizes)))
    return ranges


@contextlib.contextmanager
def _parquet(path: str, storage_options):
    pq = require("pyarrow.parquet", "parquet", f"{path}: reading Parquet")
    with (open_binary(path, storage_options) if is_url(path) else contextlib.nullcontext(path)) as src:
        pf = pq.ParquetFile(src)
        try:
            yield pf
        finally:
            pf.close()


@contextlib.contextmanager
def _arrow_stream(path: str, storage_options):
    """A RecordBatchStreamReader over a memory-mapped local file, or an fsspec file."""
    pa = require("pyarrow", "parquet", f"{path}: reading Arrow")
    source = open_binary(path, storage_options) if is_url(path) else pa.memory_map(path, "r")
    with source:
        yield pa.ipc.open_stream(source)


def read_parquet(path: str, start: int, stop: int, config: SourceConfig,
                 report: Report) -> Iterator[Doc | Skip]:
    """The documents of row groups [start, stop) of a parquet file (stop -1: to the end)."""
    key = config.text_key
    with _parquet(path, config.storage_options) as pf:
        md = pf.metadata
        problem = _schema_problem(pf.schema_arrow, key, config.records) \
            if md.num_rows else ("empty_file", "0 rows")
        if problem:
            if start == 0:
                yield report("file", *problem)
            return
        stop = md.num_row_groups if stop < 0 else stop
        counts = [md.row_group(g).num_rows for g in range(stop)]
        if min(counts, default=0) < 0:  # rows are numbered from these: they must be right
            raise ValueError(f"damaged footer: row group {counts.index(min(counts))} has "
                             f"{min(counts)} rows")
        row = sum(counts[:start])
        for g in range(start, stop):
            if config.records:  # whole rows, for a transform
                texts = pf.read_row_group(g).to_pylist()
            else:
                texts = pf.read_row_group(g, columns=[key]).column(0).to_pylist()
            if len(texts) != counts[g]:
                raise ValueError(f"damaged file: row group {g} holds {len(texts)} rows, its "
                                 f"footer says {counts[g]}")
            yield from _rows(texts, row, f"row group {g}", key, report, config.records)
            row += len(texts)


def read_arrow(path: str, start: int, stop: int, config: SourceConfig,
               report: Report) -> Iterator[Doc | Skip]:
    """The documents of record batches [start, stop) of an Arrow IPC stream (stop -1: to the end)."""
    key = config.text_key
    with _arrow_stream(path, config.storage_options) as reader:
        if problem := _schema_problem(reader.schema, key, config.records):
            if start == 0:
                yield report("file", *problem)
            return
        row = 0
        for b, batch in enumerate(reader):
            if 0 <= stop <= b:  # past the unit; the first unit looks on for a row, to know
                if start or row or batch.num_rows:  # whether the file is empty
                    return
                continue
            if b >= start:
                column = batch if config.records else batch.column(key)
                # an IPC stream has no checksum: damaged offsets would read out of bounds
                column.validate(full=True)  # (a SystemError, or worse); now an ArrowInvalid
                texts = column.to_pylist()
                yield from _rows(texts, row, f"record batch {b}", key, report, config.records)
            row += batch.num_rows
        if start == 0 and not row:  # reached the end: the whole file holds no row
            yield report("file", "empty_file", "0 rows")


def _rows(values: list, row: int, part: str, key: str, report: Report,
          records: bool) -> Iterator[Doc | Record | Skip]:
    """The texts of one row group or batch, or (``records``) its rows as dicts."""
    if not records:
        return _column_docs(values, row, part, key, report)
    return (Record(r, row + i + 1, partial(_row_place, row + i + 1, part))
            for i, r in enumerate(values))


def _row_place(n: int, part: str) -> str:
    return f"row {n} ({part})"


def _column_docs(texts: list, row: int, part: str, key: str, report: Report) -> Iterator[Doc | Skip]:
    """The texts of one row group or batch; rows numbered from row + 1 within the file."""
    for i, text in enumerate(texts):
        yield Doc(text, row + i + 1) if text else report(f"row {row + i + 1} ({part})", *(
            ("empty_document", f"{key!r} is empty") if text == "" else
            ("non_string_field", f"{key!r} is null")))


def _schema_problem(schema, key: str, records: bool) -> tuple[str, str] | None:
    """What is wrong with a file's columns: the text column named twice (with a transform, which
    gets rows by column name, any column), or (without one) missing or not strings."""
    names = schema.names
    for name in (names if records else [key]):
        if names.count(name) > 1:
            return "malformed_row", (f"the schema names column {name!r} {names.count(name)} "
                                     "times; rename all but one")
    return None if records else _column_problem(schema, key)


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
