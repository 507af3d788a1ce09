"""sources: every format, listing, unit planning (units read one by one == the whole file), bad input."""

import dataclasses
import gzip
import io
import json
import os
import pickle
import random
import re
import tracemalloc
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenmill.base.io
from tokenmill.inputs import decompress, readers, sources
from tokenmill.base.errors import ConfigError, InputError
from tokenmill.inputs.sources import (REASONS, Doc, SourceConfig, Skip, Unit, format_of, list_files,
                                      plan_units, read_documents)


def read_unit(*args, **kwargs):
    """sources.read_unit with each Doc as its text (lines: tests/test_provenance.py)."""
    for item in sources.read_unit(*args, **kwargs):
        yield item.text if isinstance(item, Doc) else item

TEXTS = [f"doc {i} é✓ 🚀" for i in range(12)]  # each document names its own position


def write(path, data) -> str:
    """Write bytes or str (UTF-8) to path, creating parents; return the path as str."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


def jsonl(texts, key="text") -> bytes:
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_parquet(path, texts, row_group_size=3) -> str:
    pq.write_table(pa.table({"text": pa.array(texts, pa.string()), "n": list(range(len(texts)))}),
                   str(path), row_group_size=row_group_size)
    return str(path)


def events(inputs, **kw) -> list:
    return list(read_documents(inputs, SourceConfig(**kw)))


def by_units(files, **kw) -> list:
    """Read every unit separately (as prepare's workers do) and concatenate."""
    config = SourceConfig(**kw)
    return [e for u in plan_units(files, config) for e in read_unit(u, config)]


def shape(items) -> list:
    """Documents as they are; skips as (where, reason)."""
    return [(e.where, e.reason) if isinstance(e, Skip) else e for e in items]


# ---- formats ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,fmt", [("a.txt", "txt"), ("d/a.jsonl", "jsonl"), ("A.JSONL.GZ", "jsonl.gz"),
                                      ("s3://b/a.jsonl.zst", "jsonl.zst"), ("x.parquet", "parquet"),
                                      ("ds/data-00000-of-00001.arrow", "arrow")])
def test_format_of(name, fmt):
    assert format_of(name) == fmt


def test_format_of_unknown_names_file_and_supported():
    with pytest.raises(InputError, match=r"data/a\.xml: unsupported.*\.jsonl\.gz.*\.parquet"):
        format_of("data/a.xml")


@pytest.mark.parametrize("kw,shown", [({"txt_mode": "words"}, "'words'"), ({"on_error": "ignore"}, "'ignore'"),
                                      ({"unit_bytes": 0}, "unit_bytes=0"), ({"text_key": ""}, "text_key=''"),
                                      ({"storage_options": [1]}, "[1]")])
def test_config_rejects_bad_values(kw, shown):
    with pytest.raises(ConfigError, match=f".*{shown}"):
        SourceConfig(**kw)


def test_config_unit_skip_pickle():
    for obj in (SourceConfig(on_error="skip", storage_options={"anon": True}), Unit("a.jsonl", 0, 5),
                Skip("a", "line 1", "malformed_json", "x")):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_txt_file_mode_verbatim(tmp_path):
    a = write(tmp_path / "a.txt", "line one\r\nline two\n\n")
    b = write(tmp_path / "b.txt", "no newline é")
    assert events(str(tmp_path)) == ["line one\r\nline two\n\n", "no newline é"]
    assert plan_units([a, b], SourceConfig(unit_bytes=1)) == [Unit(a, 0, -1), Unit(b, 0, -1)]


def test_txt_lines_mode(tmp_path):
    p = write(tmp_path / "a.txt", "a\r\nb\n\n  \nc")
    want = ["a", "b", Skip(p, "line 3", "empty_document", "empty line"), "  ", "c"]
    assert events(p, txt_mode="lines") == want  # an empty line is a Skip even under "raise"
    assert by_units([p], txt_mode="lines", unit_bytes=2) == want


def test_txt_paragraphs_mode(tmp_path):
    p = write(tmp_path / "a.txt", "\n\n p1a\r\np1b \r\n \t\n\np2\n\n\n\x0c\nlast\nline")
    want = [" p1a\np1b ", "p2", "last\nline"]
    assert events(p, txt_mode="paragraphs") == want
    for unit_bytes in range(1, 12):
        assert by_units([p], txt_mode="paragraphs", unit_bytes=unit_bytes) == want


def test_paragraphs_look_back_over_long_lines(tmp_path):
    text = "a\n" + " " * 20000 + "\nb\n" + "c" * 20000 + "\n\t\nd " * 3 + "\n\n" + "e" * 9000 + "\nf"
    p = write(tmp_path / "a.txt", text)
    want = ["a", "b\n" + "c" * 20000, "d ", "d ", "d ", "e" * 9000 + "\nf"]
    assert events(p, txt_mode="paragraphs") == want
    for unit_bytes in (100, 8191, 8193, 19999, 20003, 40000):
        assert by_units([p], txt_mode="paragraphs", unit_bytes=unit_bytes) == want


def test_jsonl_crlf_blank_lines_and_bom(tmp_path):
    data = b"\xef\xbb\xbf" + jsonl(TEXTS[:2]).replace(b"\n", b"\r\n") + b"\n   \n\t\r\n" + jsonl(TEXTS[2:4])
    p = write(tmp_path / "a.jsonl", data)
    assert events(p) == TEXTS[:4]  # blank lines are ignored without a Skip
    assert by_units([p], unit_bytes=7) == TEXTS[:4]


def test_jsonl_text_key(tmp_path):
    p = write(tmp_path / "a.jsonl", jsonl(TEXTS, key="content"))
    assert events(p, text_key="content") == TEXTS


COMPRESSORS = {"gz": lambda b: gzip.compress(b, mtime=0),
               "zst": lambda b: zstandard.ZstdCompressor().compress(b),
               "zst-frames": lambda b: b"".join(zstandard.ZstdCompressor().compress(b[i:i + 50])
                                                for i in range(0, len(b), 50))}  # many frames


def write_compressed(path, data: bytes, how: str) -> str:
    return write(path.with_name(f"{path.name}.{how[:3]}"), COMPRESSORS[how](data))


@pytest.mark.parametrize("how", list(COMPRESSORS))
def test_compressed_jsonl_units_are_decompressed_ranges_at_line_ends(tmp_path, how):
    data = jsonl(TEXTS)
    p = write_compressed(tmp_path / "a.jsonl", data, how)
    ends = [i + 1 for i, b in enumerate(data) if b == 10]
    assert plan_units([p], SourceConfig(unit_bytes=1)) == [
        Unit(p, a, b, n) for n, (a, b) in enumerate(zip([0] + ends, ends))]  # a line each
    assert plan_units([p], SourceConfig()) == [Unit(p, 0, len(data), 0)]
    for unit_bytes in (1, 40, 100, 1000):
        assert by_units([p], unit_bytes=unit_bytes) == TEXTS
        config = SourceConfig(unit_bytes=unit_bytes)
        units = plan_units([p], config)
        payloads = list(sources.unit_payloads(units, 0, config))
        assert b"".join(payloads) == data and all(map(sources.needs_payload, units))
        assert [d for u, b in zip(units, payloads) for d in read_unit(u, config, b)] == TEXTS
    assert events(p) == TEXTS


def test_parquet_units_are_row_groups(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", TEXTS, row_group_size=3)  # 4 row groups
    units = plan_units([p], SourceConfig(unit_bytes=1))
    assert units == [Unit(p, g, g + 1) for g in range(4)]
    for g, unit in enumerate(units):
        assert list(read_unit(unit, SourceConfig())) == TEXTS[3 * g: 3 * g + 3]
    assert plan_units([p], SourceConfig()) == [Unit(p, 0, 4)]  # tiny groups are grouped
    assert events(p) == TEXTS


@pytest.mark.parametrize("column", [pa.array(TEXTS, pa.large_string()), pa.array(TEXTS).dictionary_encode()])
def test_parquet_string_like_columns(tmp_path, column):
    pq.write_table(pa.table({"text": column}), str(tmp_path / "a.parquet"), row_group_size=5)
    assert events(str(tmp_path / "a.parquet")) == TEXTS


# ---- listing -------------------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    write(tmp_path / "d" / "b.jsonl", jsonl(["b"]))
    write(tmp_path / "d" / "sub" / "a.txt", "a")
    write(tmp_path / "d" / "sub" / "notes.md", "ignored")
    write(tmp_path / "d" / "c.jsonl.gz", gzip.compress(jsonl(["c"])))
    write_parquet(tmp_path / "z.parquet", ["z"])
    return tmp_path


def test_list_directory_recursive_sorted(tree):
    files, skips = list_files(str(tree / "d"))
    assert files == sorted(str(tree / "d" / n) for n in ("b.jsonl", "c.jsonl.gz", "sub/a.txt")) and skips == []
    assert events(str(tree / "d")) == ["b", "c", "a"]


def test_list_globs_dedup_and_order(tree):
    t = str(tree)
    files, _ = list_files([f"{t}/z.parquet", f"{t}/**/*.jsonl*", f"{t}/d/./b.jsonl", f"{t}/d/*"])
    assert files == [f"{t}/d/b.jsonl", f"{t}/d/c.jsonl.gz", f"{t}/d/sub/a.txt", f"{t}/z.parquet"]


def test_list_missing_input(tree):
    missing = str(tree / "nope" / "*.jsonl")
    with pytest.raises(InputError, match=r"nope/\*\.jsonl: no file matched") as e:
        list_files([str(tree / "z.parquet"), missing])
    assert e.value.reason == "no_match" and e.value.path == missing
    files, skips = list_files([str(tree / "z.parquet"), missing], on_error="skip")
    assert files == [str(tree / "z.parquet")]
    assert skips == [Skip(missing, "file", "no_match", "no supported file matches")]
    assert events([str(tree / "z.parquet"), missing], on_error="skip") == [skips[0], "z"]


def test_list_nothing_matched_is_always_an_error(tmp_path):
    write(tmp_path / "readme.md", "x")
    with pytest.raises(InputError, match=f"{tmp_path}: no file matched .no supported file inside"):
        list_files([str(tmp_path), str(tmp_path / "x.jsonl")])
    with pytest.raises(InputError, match="no input file matched: "):
        list_files([str(tmp_path), str(tmp_path / "x.jsonl")], on_error="skip")


def test_list_named_file_of_unknown_type(tmp_path):
    with pytest.raises(InputError, match="unsupported file type"):
        list_files(write(tmp_path / "a.xml", "x"))


def test_file_urls(tree):
    url = f"file://{tree}/d"
    files, _ = list_files(url)
    assert files == [f"file://{tree}/d/b.jsonl", f"file://{tree}/d/c.jsonl.gz", f"file://{tree}/d/sub/a.txt"]
    assert events(url) == ["b", "c", "a"]


@pytest.fixture
def memfs():
    fs, root = fsspec.filesystem("memory"), f"/tm-{uuid.uuid4().hex}"
    yield fs, root
    fs.rm(root, recursive=True)


def test_memory_urls(memfs):
    fs, root = memfs
    fs.pipe(f"{root}/a.jsonl", jsonl(TEXTS[:6]))
    fs.pipe(f"{root}/b.jsonl.gz", gzip.compress(jsonl(TEXTS[6:8])))
    fs.pipe(f"{root}/c/d.txt", b"x\n\ny")
    with fs.open(f"{root}/e.parquet", "wb") as f:
        pq.write_table(pa.table({"text": TEXTS[8:]}), f, row_group_size=1)
    files, _ = list_files(f"memory://{root}")
    assert files == [f"memory://{root}/{n}" for n in ("a.jsonl", "b.jsonl.gz", "c/d.txt", "e.parquet")]
    want = TEXTS[:8] + ["x", "y"] + TEXTS[8:]
    assert events(f"memory://{root}", txt_mode="paragraphs") == want
    assert by_units(files, txt_mode="paragraphs", unit_bytes=20) == want
    assert len(plan_units(files, SourceConfig(unit_bytes=20))) > 8
    assert list_files(f"memory://{root}/*.jsonl*")[0] == files[:2]


# ---- Hugging Face datasets (save_to_disk): Arrow IPC streams --------------------------------------

DOCS = [f"row {i} é✓ 🚀" + "x" * (i % 7) for i in range(2600)]  # each names its own position


@pytest.fixture(scope="module")
def hf_dataset(tmp_path_factory):
    """A real dataset saved by the `datasets` package: 2 data files of 1,300 rows, record batches
    of 1,000 rows (datasets' own writer), plus a cache file that is not part of it."""
    import datasets  # a dev dependency: missing means the install is broken, not a skip
    root = tmp_path_factory.mktemp("hf") / "ds"
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(
        str(root), num_shards=2)
    pa.ipc.new_stream(str(root / "cache-0123.arrow"), pa.schema([("text", pa.string())])).close()
    return root


def test_dataset_directory_lists_its_data_files(hf_dataset, tmp_path):
    names = [f"data-0000{i}-of-00002.arrow" for i in range(2)]
    assert sorted(os.listdir(hf_dataset)) == sorted(["cache-0123.arrow", "dataset_info.json", "state.json"] + names)
    want = [str(hf_dataset / n) for n in names]
    assert sources.dataset_files(str(hf_dataset)) == want
    assert list_files(str(hf_dataset)) == (want, [])
    assert list_files(str(hf_dataset.parent))[0] == want  # a walk takes the dataset, not the cache file
    assert list_files(f"file://{hf_dataset}")[0] == [f"file://{f}" for f in want]


def test_dataset_documents_and_record_batch_units(hf_dataset):
    files, _ = list_files(str(hf_dataset))
    assert events(str(hf_dataset)) == DOCS
    units = plan_units(files, SourceConfig(unit_bytes=1))
    assert units == [Unit(f, b, b + 1) for f in files for b in (0, 1)]  # 1,300 rows: batches 1,000 + 300
    assert by_units(files, unit_bytes=1) == DOCS
    assert plan_units(files, SourceConfig()) == [Unit(f, 0, 2) for f in files]
    assert list(read_unit(Unit(files[1], 1, 2), SourceConfig())) == DOCS[2300:]


def test_prepare_reads_a_dataset(hf_dataset, tmp_path):
    from tokenmill.prepare import prepare
    from tokenmill.store import TokenStore
    m = prepare([str(hf_dataset)], out=tmp_path / "s", workers=1, unit_bytes=4000, progress=False)
    assert m["num_documents"] == len(DOCS) and m["settings"]["num_files"] == 2
    with TokenStore(tmp_path / "s") as store:
        assert [store[i].tolist() for i in (0, 1299, 1300, 2599)] == [
            list(DOCS[i].encode()) + [256] for i in (0, 1299, 1300, 2599)]


def test_dataset_dict_lists_the_split_asked_for(tmp_path):
    import datasets  # a dev dependency: missing means the install is broken, not a skip
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"holds 2 splits \(test \(1 file\), train \(1 file\)\)"):
        list_files(str(tmp_path / "dd"))  # both together would leak test data into training
    for s in ("test", "train"):
        files, _ = list_files(str(tmp_path / "dd"), split=s)
        assert files == [str(tmp_path / "dd" / s / "data-00000-of-00001.arrow")]
    assert events(str(tmp_path / "dd" / "train")) == ["a", "b"]


def test_loose_arrow_files_only_when_named(tmp_path):
    a = tmp_path / "loose" / "a.arrow"
    a.parent.mkdir()
    with pa.ipc.new_stream(str(a), pa.schema([("text", pa.string())])) as w:
        w.write_batch(pa.record_batch([pa.array(["p", "q"])], names=["text"]))
    write(tmp_path / "loose" / "b.jsonl", jsonl(["r"]))
    assert list_files(str(tmp_path / "loose"))[0] == [str(tmp_path / "loose" / "b.jsonl")]
    assert list_files(f"{tmp_path}/loose/*")[0] == [str(tmp_path / "loose" / "b.jsonl")]
    assert list_files(f"{tmp_path}/loose/*.arrow")[0] == [str(a)]
    assert events([str(a), str(tmp_path / "loose")]) == ["p", "q", "r"]


def write_stream(path, batches, schema=None) -> str:
    """An Arrow IPC stream of the given record batches (lists of texts), as datasets writes."""
    schema = schema or pa.schema([("text", pa.string())])
    with pa.ipc.new_stream(str(path), schema) as w:
        for b in batches:
            w.write_batch(pa.record_batch([pa.array(b, schema.field(0).type)], schema=schema))
    return str(path)


@pytest.mark.parametrize("batches,schema,reason,where,detail", [
    ([["a"]], pa.schema([("body", pa.string())]), "missing_field", "file", "no column 'text'; columns are body"),
    ([[1, 2]], pa.schema([("text", pa.int64())]), "non_string_field", "file", "column 'text' has type int64"),
    ([[], []], None, "empty_file", "file", "0 rows"),
    ([["a", "b"], ["c", None]], None, "non_string_field", "row 4 (record batch 1)", "'text' is null")])
def test_bad_arrow_stream(tmp_path, batches, schema, reason, where, detail):
    p = write_stream(tmp_path / "a.arrow", batches, schema)
    assert_raised_then_skipped(p, where, reason, detail, ["a", "b", "c", None])


def test_empty_texts_in_a_dataset_are_skipped_with_their_row(tmp_path):
    p = write_stream(tmp_path / "a.arrow", [["a", ""], ["b"]])
    assert shape(events(p)) == ["a", ("row 2 (record batch 0)", "empty_document"), "b"]


def test_corrupt_or_missing_data_file_is_unreadable(tmp_path):
    root = tmp_path / "ds"
    write(root / "state.json", json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                           {"filename": "data-00001-of-00002.arrow"}]}))
    good = write_stream(root / "data-00000-of-00002.arrow", [["a"]])
    files, _ = list_files(str(root))
    assert files == [good, str(root / "data-00001-of-00002.arrow")]
    assert shape(events(str(root), on_error="skip")) == ["a", ("file", "unreadable")]
    write(root / "data-00001-of-00002.arrow", b"not an arrow stream at all")
    with pytest.raises(InputError, match=r"data-00001-of-00002\.arrow: cannot read file"):
        events(str(root))


def test_dataset_on_a_memory_url(memfs):
    fs, root = memfs
    fs.pipe(f"{root}/ds/state.json", json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}).encode())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as w:
        w.write_batch(pa.record_batch([pa.array(TEXTS[:5])], names=["text"]))
        w.write_batch(pa.record_batch([pa.array(TEXTS[5:])], names=["text"]))
    fs.pipe(f"{root}/ds/data-00000-of-00001.arrow", sink.getvalue().to_pybytes())
    fs.pipe(f"{root}/ds/cache-1.arrow", sink.getvalue().to_pybytes())
    fs.pipe(f"{root}/b.jsonl", jsonl(["b"]))
    files, _ = list_files(f"memory://{root}")
    assert files == [f"memory://{root}/b.jsonl", f"memory://{root}/ds/data-00000-of-00001.arrow"]
    assert events(f"memory://{root}") == ["b"] + TEXTS
    assert plan_units(files[1:], SourceConfig(unit_bytes=1)) == [Unit(files[1], 0, -1)]


# ---- units read one by one == the whole file ---------------------------------------------------

LINE_CHARS = st.sampled_from(["a", "é", "✓", "🚀", " ", "\t", "\r", "\x0c", '"', "\\", "{"])
EOLS = st.sampled_from([b"\n", b"\r\n"])


def join_lines(lines: list[bytes], eols: list[bytes], trailing: bool) -> bytes:
    out = b"".join(line + eol for line, eol in zip(lines, eols))
    return out if trailing or not lines else out[:-len(eols[len(lines) - 1])]


def line_oracle(data: bytes, mode: str) -> list:
    """What reading a .txt in lines/paragraphs mode must give, written the obvious way."""
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    out, para, bad = [], [], None
    for n, raw in enumerate(lines, 1):
        raw = raw[:-1] if raw.endswith(b"\r") else raw
        try:
            line = raw.decode()
        except UnicodeDecodeError:
            line = None
        if mode == "lines":
            out.append(line if line else (f"line {n}", "invalid_utf8" if line is None else "empty_document"))
        elif line is not None and not line.strip(" \t\r\f\v"):
            if para:
                out.append(bad or "\n".join(para))
            para, bad = [], None
        else:
            bad = bad or (None if line is not None else (f"line {n}", "invalid_utf8"))
            para.append(line or "")
    if para:
        out.append(bad or "\n".join(para))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(st.text(LINE_CHARS, max_size=6).map(str.encode), st.just(b"\xc3\x28")),
                      max_size=14),
       eols=st.lists(EOLS, min_size=14, max_size=14), trailing=st.booleans(), data=st.data(),
       mode=st.sampled_from(["lines", "paragraphs"]))
def test_txt_units_concatenate_to_whole_file(tmp_path, monkeypatch, lines, eols, trailing, data, mode):
    monkeypatch.setattr(readers, "_CHUNK", data.draw(st.sampled_from([2, 3, 5, 64, 1 << 20])))
    raw = join_lines(lines, eols, trailing)
    p = write(tmp_path / "a.txt", raw)
    whole = list(read_unit(Unit(p, 0, -1), SourceConfig(txt_mode=mode, on_error="skip")))
    if raw:
        assert shape(whole) == line_oracle(raw, mode)
    unit_bytes = data.draw(st.integers(1, len(raw) + 2))
    assert by_units([p], txt_mode=mode, on_error="skip", unit_bytes=unit_bytes) == (
        whole if raw else [Skip(p, "file", "empty_file", "0 bytes")])


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)  # any unicode, "\n" included
RECORDS = st.one_of(
    TEXT.map(lambda t: (t, json.dumps({"text": t}).encode())),
    TEXT.map(lambda t: (t, json.dumps({"text": t}, ensure_ascii=False).encode())),
    st.sampled_from([(("malformed_json",), b'{"text": oops}'), (("missing_field",), b'{"body": "x"}'),
                     (("non_string_field",), b'{"text": 3}'), (("invalid_utf8",), b'{"text": "\xff"}'),
                     (None, b""), (None, b"  \t")]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(RECORDS, max_size=12), eols=st.lists(EOLS, min_size=12, max_size=12),
       trailing=st.booleans(), data=st.data())
def test_jsonl_units_concatenate_to_whole_file(tmp_path, monkeypatch, records, eols, trailing, data):
    monkeypatch.setattr(readers, "_CHUNK", data.draw(st.sampled_from([2, 3, 5, 64, 1 << 20])))
    raw = join_lines([r for _, r in records], eols, trailing)
    p = write(tmp_path / "a.jsonl", raw)
    want = []
    for n, (kind, _) in enumerate(records, 1):
        if isinstance(kind, str):
            want.append(kind or (f"line {n}", "empty_document"))
        elif kind:
            want.append((f"line {n}", kind[0]))
    whole = list(read_unit(Unit(p, 0, -1), SourceConfig(on_error="skip")))
    if raw:
        assert shape(whole) == want
    unit_bytes = data.draw(st.integers(1, len(raw) + 2))
    assert by_units([p], on_error="skip", unit_bytes=unit_bytes) == (
        whole if raw else [Skip(p, "file", "empty_file", "0 bytes")])


# ---- bad input ---------------------------------------------------------------------------------

BAD_JSONL = [("malformed_json", b'{"text": "x" "y"}', "Expecting ',' delimiter: column 14"),
             ("malformed_json", b"[1, 2]", "expected a JSON object, got an array"),
             ("malformed_json", b'"just text"', "expected a JSON object, got a string"),
             ("missing_field", b'{"body": "x", "id": 1}', "no 'text' key; keys are 'body', 'id'; its text may be under --text-key body"),
             ("non_string_field", b'{"text": null}', "'text' is null"),
             ("non_string_field", b'{"text": 5}', "'text' is a number"),
             ("non_string_field", b'{"text": ["a"]}', "'text' is an array"),
             ("invalid_utf8", b'{"text": "caf\xe9"}', "invalid continuation byte at column 14")]


@pytest.mark.parametrize("reason,line,detail", BAD_JSONL)
def test_bad_jsonl_line(tmp_path, reason, line, detail):
    p = write(tmp_path / "a.jsonl", jsonl([f"g{i}" for i in range(40)]) + line + b"\n" + jsonl(TEXTS))
    assert plan_units([p], SourceConfig(unit_bytes=64))[-1].start > 0  # the bad line is mid-file
    with pytest.raises(InputError) as e:
        events(p, unit_bytes=64)
    assert str(e.value).startswith(f"{p}:41: ") and detail in str(e.value)
    assert str(e.value).endswith("; fix the line or pass --on-error skip")
    assert (e.value.path, e.value.where, e.value.reason) == (p, "line 41", reason)
    want = [f"g{i}" for i in range(40)] + [Skip(p, "line 41", reason, detail)] + TEXTS
    assert events(p, unit_bytes=64, on_error="skip") == want
    assert events(p, on_error="skip") == want


def test_malformed_json_message(tmp_path):
    p = write(tmp_path / "a.jsonl", b'{"text": "a"}\n{"text": "x" "y"}\n')
    with pytest.raises(InputError, match=r"a\.jsonl:2: malformed JSON \(Expecting ',' delimiter: column 14\); "
                                         r"fix the line or pass --on-error skip$"):
        events(p)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_empty_documents_are_always_skipped(tmp_path, policy):
    j = write(tmp_path / "a.jsonl", jsonl(["a", "", "b"]))
    pq_ = write_parquet(tmp_path / "b.parquet", ["c", "", "d"], row_group_size=2)
    t = write(tmp_path / "c.txt", "e\n\nf\n")
    assert events(str(tmp_path), on_error=policy, txt_mode="lines") == [
        "a", Skip(j, "line 2", "empty_document", "'text' is empty"), "b",
        "c", Skip(pq_, "row 2 (row group 0)", "empty_document", "'text' is empty"), "d",
        "e", Skip(t, "line 2", "empty_document", "empty line"), "f"]


@pytest.mark.parametrize("mode,data,where", [("lines", b"ok\nok\nbad\xff\nok", "line 3"),
                                             ("paragraphs", b"ok\n\npara\nbad\xff\nstill\n\nok", "line 4"),
                                             ("file", b"ok\nok\nbad\xff\nok", "line 3")])
def test_invalid_utf8_txt(tmp_path, mode, data, where):
    p = write(tmp_path / "a.txt", data)
    with pytest.raises(InputError, match=f"a.txt:{where[5:]}: invalid UTF-8 .invalid start byte at column 4") as e:
        events(p, txt_mode=mode)
    assert e.value.reason == "invalid_utf8"
    got = events(p, txt_mode=mode, on_error="skip")
    assert Skip(p, where, "invalid_utf8", "invalid start byte at column 4") in got
    assert [x for x in got if isinstance(x, str)] == {"lines": ["ok", "ok", "ok"], "paragraphs": ["ok", "ok"],
                                                      "file": []}[mode]


def empty_parquet(path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(path))
    return str(path)


@pytest.mark.parametrize("make", [
    lambda d: write(d / "e.jsonl", b""), lambda d: write(d / "e.txt", b""),
    lambda d: write(d / "e.jsonl.gz", gzip.compress(b"")),
    lambda d: write(d / "e.jsonl.zst", zstandard.ZstdCompressor().compress(b"")),
    lambda d: empty_parquet(d / "e.parquet")])
@pytest.mark.parametrize("mode", ["file", "lines"])
def test_empty_file(tmp_path, make, mode):
    p = make(tmp_path)
    good = write(tmp_path / "good.jsonl", jsonl(["g"]))
    with pytest.raises(InputError, match=f"{p}: empty file") as e:
        events(p, txt_mode=mode)
    assert (e.value.reason, e.value.where) == ("empty_file", "file")
    assert shape(events([p, good], txt_mode=mode, on_error="skip")) == [("file", "empty_file"), "g"]


@pytest.mark.parametrize("name,data", [("a.jsonl", jsonl(TEXTS) + b'{"text": "\x00"}\n' + jsonl(TEXTS)),
                                       ("a.txt", b"text\x00text\n" * 50)])
def test_binary_file(tmp_path, name, data):
    p = write(tmp_path / name, data)
    with pytest.raises(InputError, match=f"{name}: binary file") as e:
        events(p, txt_mode="lines")
    assert e.value.reason == "binary_file"
    assert by_units([p], txt_mode="lines", on_error="skip", unit_bytes=40) == [
        Skip(p, "file", "binary_file", f"NUL byte at offset {data.index(0)}")]  # once, not per unit


def test_vanished_file_is_unreadable(tmp_path):
    p = write(tmp_path / "a.jsonl", jsonl(TEXTS))
    files, _ = list_files(p)
    os.remove(p)
    with pytest.raises(InputError, match=f"{p}: cannot read file .FileNotFoundError") as e:
        plan_units(files, SourceConfig())
    assert e.value.reason == "unreadable"
    units = plan_units(files, SourceConfig(on_error="skip"))
    assert shape(read_unit(units[0], SourceConfig(on_error="skip"))) == [("file", "unreadable")]
    with pytest.raises(InputError, match="cannot read file"):
        list(read_unit(Unit(p, 10, 20), SourceConfig()))


def test_directory_named_like_a_file_is_unreadable(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    assert shape(read_unit(Unit(str(tmp_path / "d.jsonl"), 0, -1), SourceConfig(on_error="skip"))) == [
        ("file", "unreadable")]


def test_permission_denied_is_unreadable(tmp_path, monkeypatch):
    p = write(tmp_path / "a.txt", "x")
    denied = PermissionError(13, "Permission denied", p)

    def deny(*args, **kwargs):
        raise denied
    monkeypatch.setattr(tokenmill.base.io, "open", deny, raising=False)  # root may read any file: simulate
    assert events(p, on_error="skip") == [Skip(p, "file", "unreadable", f"PermissionError: {denied}")]
    with pytest.raises(InputError, match=f"{p}: cannot read file .PermissionError.*; "
                                         "check that it exists and is readable, or pass --on-error skip"):
        events(p)


def truncated(b: bytes) -> bytes:
    return b[: len(b) // 2]


def garbled(b: bytes) -> bytes:
    return b[:20] + bytes(x ^ 0x5A for x in b[20:-20]) + b[-20:]


BIG = jsonl([f"doc {i} " + "x" * (i % 50) for i in range(3000)])


@pytest.mark.parametrize("name,data", [
    ("a.jsonl.gz", truncated(gzip.compress(BIG))), ("a.jsonl.gz", garbled(gzip.compress(BIG))),
    ("a.jsonl.gz", BIG), ("a.jsonl.zst", truncated(zstandard.ZstdCompressor().compress(BIG))),
    ("a.jsonl.zst", garbled(zstandard.ZstdCompressor().compress(BIG))), ("a.jsonl.zst", BIG),
    ("a.jsonl.gz", b"\x1f\x8b" + b"\x00" * 30), ("a.parquet", b"PAR1 not really PAR1")])
def test_corrupt_files_are_unreadable(tmp_path, name, data):
    p = write(tmp_path / name, data)
    good = write(tmp_path / "b.jsonl", jsonl(["good"]))
    with pytest.raises(InputError, match=f"{name}: cannot read file") as e:
        events([p, good])
    assert (e.value.path, e.value.reason) == (p, "unreadable")
    got = events([p, good], on_error="skip")
    assert got[-2:] == [got[-2], "good"] and shape(got[-2:-1]) == [("file", "unreadable")]
    assert got[:-2] == [json.loads(line)["text"] for line in BIG.splitlines()[:len(got) - 2]]  # a true prefix


@pytest.mark.parametrize("table,reason,where,detail", [
    (pa.table({"body": ["a"]}), "missing_field", "file", "no column 'text'; columns are body"),
    (pa.table({"text": [1, 2]}), "non_string_field", "file", "column 'text' has type int64"),
    (pa.table({"text": ["a", "b", "c", "d", None, "f"]}), "non_string_field", "row 5 (row group 1)", "'text' is null")])
def test_bad_parquet(tmp_path, table, reason, where, detail):
    p = str(tmp_path / "a.parquet")
    pq.write_table(table, p, row_group_size=3)
    assert_raised_then_skipped(p, where, reason, detail, ["a", "b", "c", "d", None, "f"])


def assert_raised_then_skipped(p, where, reason, detail, rows):
    """A bad columnar file: InputError naming ``where`` and ``reason`` by default; with
    on_error="skip", that one Skip, and for a bad row the other ``rows`` (None: the bad one)."""
    with pytest.raises(InputError) as e:
        events(p, unit_bytes=1)
    assert (e.value.path, e.value.where, e.value.reason) == (p, where, reason) and detail in str(e.value)
    got = events(p, unit_bytes=1, on_error="skip")
    skip = Skip(p, where, reason, detail)
    assert [x for x in got if isinstance(x, Skip)] == [skip]
    if where != "file":
        assert got == [skip if r is None else r for r in rows]


def test_reasons_are_the_contract():
    """prepare, the CLI and the manifest count skips by these names: only add, never rename."""
    assert REASONS == ("malformed_json", "missing_field", "non_string_field", "invalid_utf8", "empty_document",
                       "empty_file", "no_match", "unreadable", "binary_file", "transform_error",
                       "dropped_by_transform", "held_out", "malformed_row")


def test_paragraph_after_a_bom_only_first_line_is_kept_by_every_split(tmp_path):
    # found by the fault suite's fuzzer: a unit starting inside the file looked back at a line
    # holding only the byte-order mark, took it for text, and so owned no paragraph
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf\n0")
    for unit_bytes in (1, 2, 3, 4, 5, 1 << 20):
        config = SourceConfig(txt_mode="paragraphs", unit_bytes=unit_bytes)
        docs = [d for u in plan_units([str(path)], config) for d in read_unit(u, config)]
        assert docs == ["0"], unit_bytes


# ---- compressed streams: units of decompressed text ----------------------------------------------

@pytest.mark.parametrize("blocks,unit_bytes,want", [
    ([b"ab\ncd\n", b"e\nf"], 4, [(6, 2), (9, 3)]),
    ([b"ab\ncd\n", b"e\nf"], 3, [(3, 1), (6, 2), (9, 3)]),  # a "\n" at the unit_bytes-th byte cuts there
    ([b"abcdef", b"gh\ni\n"], 2, [(9, 1), (11, 2)]),  # a line longer than a block and a unit
    ([b"a\n"], 5, [(2, 1)]), ([], 5, []), ([b"", b"a"], 1, [(1, 0)])])
def test_cuts(blocks, unit_bytes, want):
    assert list(readers.cuts(blocks, unit_bytes)) == want


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=60).map(lambda b: b.replace(b"x", b"\n")), unit_bytes=st.integers(1, 70),
       splits=st.lists(st.integers(0, 60), max_size=5))
def test_cuts_are_line_ends_past_unit_bytes_wherever_the_blocks_split(data, unit_bytes, splits):
    bounds = sorted({0, len(data), *(min(s, len(data)) for s in splits)})
    got = list(readers.cuts([data[a:b] for a, b in zip(bounds, bounds[1:])], unit_bytes))
    assert got == list(readers.cuts([data], unit_bytes))
    start = 0
    for i, (stop, lines) in enumerate(got):
        assert lines == data[:stop].count(b"\n")
        if i < len(got) - 1 or stop < len(data) or data.endswith(b"\n"):
            assert data[stop - 1] == 10 or stop == len(data)
        # the unit holds at least unit_bytes, and its last line is the one crossing unit_bytes
        assert stop - start >= unit_bytes or stop == len(data)
        assert b"\n" not in data[start + unit_bytes - 1: stop - 1]
        start = stop
    assert start == len(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(RECORDS, max_size=12), eols=st.lists(EOLS, min_size=12, max_size=12),
       trailing=st.booleans(), how=st.sampled_from(list(COMPRESSORS)), data=st.data())
def test_compressed_units_read_alone_or_with_payloads_give_the_whole_stream(
        tmp_path, monkeypatch, records, eols, trailing, how, data):
    monkeypatch.setattr(readers, "_CHUNK", data.draw(st.sampled_from([2, 3, 5, 64, 1 << 20])))
    raw = join_lines([r for _, r in records], eols, trailing)
    p = write_compressed(tmp_path / "a.jsonl", raw, how)
    config = SourceConfig(on_error="skip", unit_bytes=data.draw(st.integers(1, len(raw) + 2)))
    whole = list(read_unit(Unit(p, 0, -1), config))
    units = plan_units([p], config)
    alone = [d for u in units for d in read_unit(u, config)]  # each decompresses from 0 itself
    first = data.draw(st.integers(0, len(units)))
    payloads = list(sources.unit_payloads(units, first, config))  # a resumed run: from unit `first`
    assert len(payloads) == len(units) - first
    shipped = [d for u, b in zip(units[first:], payloads) for d in read_unit(u, config, b)]
    assert alone == whole and shipped == [d for u in units[first:] for d in read_unit(u, config)]
    if raw:
        assert all(u.stop - u.start == len(b) for u, b in zip(units[first:], payloads))


def test_compressed_errors_name_the_file_and_line_in_any_unit(tmp_path):
    data = jsonl([f"g{i}" for i in range(200)]) + b'{"text": oops}\n' + jsonl(TEXTS)
    p = write_compressed(tmp_path / "a.jsonl", data, "zst")
    config = SourceConfig(unit_bytes=100)
    units = plan_units([p], config)
    assert len(units) > 10 and units[-1].line > 150
    with pytest.raises(InputError, match=r"a\.jsonl\.zst:201: malformed JSON") as e:
        for u, b in zip(units, sources.unit_payloads(units, 0, config)):
            list(read_unit(u, config, b))
    assert e.value.where == "line 201"
    assert Skip(p, "line 201", "malformed_json", "Expecting value: column 10") in events(
        p, unit_bytes=100, on_error="skip")


@pytest.mark.parametrize("how", ["gz", "zst"])
@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_file_changed_after_planning_is_an_error_naming_it_under_either_policy(tmp_path, how,
                                                                                 on_error):
    p = write_compressed(tmp_path / "a.jsonl", jsonl(TEXTS), how)
    config = SourceConfig(on_error=on_error, unit_bytes=60)
    units = plan_units([p], config)
    write_compressed(tmp_path / "a.jsonl", jsonl(TEXTS[:3]), how)  # shorter now
    payloads = list(sources.unit_payloads(units, 0, config))
    assert payloads[0] is not None and payloads[-1] is None  # the parent gives up; the unit says why
    for unit, payload in zip(units, payloads):  # every unit: none gives the new file's documents
        with pytest.raises(InputError, match=rf"^{re.escape(p)}: the file changed while it was "
                           r"being read \(replaced, truncated or rewritten: size \d+ → \d+ bytes\)"):
            list(read_unit(unit, config, payload))
    if on_error == "skip":  # units made by hand carry no identity: the old hint remains
        unchecked = [dataclasses.replace(u, ident=None) for u in units]
        got = [d for u, b in zip(unchecked, payloads) for d in read_unit(u, config, b)]
        assert "did the file change since it was planned?" in got[-1].detail


def test_damaged_stream_keeps_the_units_planned_before_the_damage(tmp_path):
    rng = random.Random(0)  # text that does not repeat: the cut falls many blocks into the stream
    data = jsonl([rng.randbytes(rng.randrange(10, 300)).hex() for _ in range(10_000)])
    blob = zstandard.ZstdCompressor().compress(data)
    p = write(tmp_path / "a.jsonl.zst", blob[: len(blob) * 3 // 4])
    config = SourceConfig(on_error="skip", unit_bytes=20_000)
    units = plan_units([p], config)
    assert len(units) > 5 and units[-1].stop == -1 and units[-1].start > 0
    with pytest.raises(InputError, match=r"a\.jsonl\.zst: cannot read file \(EOFError: zstd stream ends inside"):
        plan_units([p], SourceConfig(unit_bytes=20_000))
    got = [d for u, b in zip(units, sources.unit_payloads(units, 0, config)) for d in read_unit(u, config, b)]
    assert shape(got[-1:]) == [("file", "unreadable")]
    assert got[:-1] == [json.loads(line)["text"] for line in data.splitlines()[:len(got) - 1]]
    assert len(got) > len(data.splitlines()) // 2


@pytest.mark.parametrize("data,reason", [(b"", "empty_file"), (b'{"text": "a"}\n\x00\n' * 3, "binary_file")])
def test_empty_or_binary_stream_is_one_unit_reported_once(tmp_path, data, reason):
    p = write_compressed(tmp_path / "a.jsonl", data, "gz")
    assert plan_units([p], SourceConfig(unit_bytes=1)) == [Unit(p, 0, -1, 0)]
    assert shape(events(p, unit_bytes=1, on_error="skip")) == [("file", reason)]


def test_payload_for_a_seekable_unit_is_refused(tmp_path):
    p = write(tmp_path / "a.jsonl", jsonl(TEXTS))
    assert not sources.needs_payload(Unit(p, 0, 10)) and not sources.needs_payload(Unit(p + ".gz", 0, -1))
    with pytest.raises(TypeError, match="only for a compressed stream"):
        list(read_unit(Unit(p, 0, -1), SourceConfig(), b"x"))


# ---- long documents --------------------------------------------------------------------------

def test_a_huge_txt_read_whole_warns_once_naming_file_and_size(tmp_path):
    big = tmp_path / "book.txt"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: planning only looks at the size
    small = write(tmp_path / "small.txt", "x")
    with pytest.warns(UserWarning, match=r"book\.txt: 68,157,440 bytes of text become ONE document "
                                         r"\(txt_mode='file'\).*--txt-mode") as caught:
        plan_units([str(big), small], SourceConfig())
        plan_units([str(big)], SourceConfig())
    assert len(caught) == 1
    assert len(plan_units([str(big)], SourceConfig(txt_mode="lines", unit_bytes=64 << 20))) == 2


# ---- what a walk passes over -----------------------------------------------------------------

def test_a_walk_says_what_it_ignored_by_extension(tree, hf_dataset, tmp_path):
    d = tree / "d"
    for name in ("README.md", "data.xml", "data.jsonx", "sub/x.jsonl.bz2", "Makefile", "loose.arrow"):
        write(d / name, "x")
    listing = sources.list_inputs(str(d))
    assert listing.files == list_files(str(d))[0] == [str(d / n) for n in ("b.jsonl", "c.jsonl.gz", "sub/a.txt")]
    assert listing.ignored.counts == ((".md", 2), ("(no extension)", 1), (".arrow", 1), (".bz2", 1),
                                      (".jsonx", 1), (".xml", 1))
    assert str(listing.ignored).startswith("ignored 7 files: 2 .md, 1 (no extension), 1 .arrow, 1 .bz2, ")
    assert listing.ignored.examples == tuple(sorted(str(d / n) for n in ("Makefile", "README.md", "data.jsonx")))
    assert sources.list_inputs(f"file://{d}").ignored.counts == listing.ignored.counts
    glob = sources.list_inputs(f"{d}/*.json*")  # the glob matched data.jsonx: passed over too
    assert str(glob.ignored) == f"ignored 1 file: 1 .jsonx (e.g. {d}/data.jsonx)"
    assert not sources.list_inputs(str(hf_dataset)).ignored  # a dataset's own files are not "ignored"
    assert not sources.list_inputs(str(d / "b.jsonl")).ignored and str(sources.Ignored()) == "ignored 0 files"


def test_nothing_readable_in_a_folder_says_what_was_there(tmp_path):
    write(tmp_path / "README.md", "x")
    write(tmp_path / "data.xml", "x")
    with pytest.raises(InputError, match=r"no file matched \(no supported file inside; found only "
                                         r"1 \.md, 1 \.xml\); check the path"):
        list_files(str(tmp_path))
    with pytest.raises(InputError, match=r"no input file matched: .*; ignored 2 files: 1 \.md, 1 \.xml"):
        list_files(str(tmp_path), on_error="skip")


def test_memory_url_walk_counts_ignored(memfs):
    fs, root = memfs
    fs.pipe(f"{root}/a.jsonl", jsonl(["a"]))
    fs.pipe(f"{root}/n/notes.md", b"x")
    listing = sources.list_inputs(f"memory://{root}")
    assert listing.files == [f"memory://{root}/a.jsonl"]
    assert str(listing.ignored) == f"ignored 1 file: 1 .md (e.g. memory://{root}/n/notes.md)"


# ---- zstd: block by block ----------------------------------------------------------------------

def zstd_read(blob: bytes) -> bytes:
    with decompress._ZstdStream(io.BytesIO(blob)) as raw, io.BufferedReader(raw) as f:
        return f.read()


@pytest.mark.parametrize("kw", [{}, {"write_checksum": True}, {"write_content_size": False},
                                {"level": 19, "write_checksum": True}, {"write_dict_id": True}])
def test_zstd_frames_of_every_header_shape_and_skippable_frames(kw):
    parts = [jsonl(TEXTS[:6]), b"", jsonl(TEXTS[6:]) * 50]
    frames = [zstandard.ZstdCompressor(**kw).compress(p) for p in parts]
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    blob = frames[0] + skippable + frames[1] + frames[2]
    assert zstd_read(blob) == b"".join(parts)
    ends = {len(frames[0]), len(frames[0]) + len(skippable), len(frames[0]) + len(skippable) + len(frames[1]),
            len(blob)}
    for cut in range(len(blob)):  # cut anywhere: the frames before, or an error, never less silently
        try:
            got = zstd_read(blob[:cut])
        except (EOFError, zstandard.ZstdError):
            assert cut not in ends and cut > 0
        else:
            assert cut in ends | {0} and b"".join(parts).startswith(got)
    with pytest.raises(ValueError, match="not a zstd frame"):
        zstd_read(blob + b"garbage!")


def test_zstd_output_stays_small_however_compressible(tmp_path):
    """256 MiB of one byte is ~8 KB of zstd: a decompressor fed 64 KiB at a time would hand it
    all back at once; block by block, no piece is over 128 KiB."""
    blob = zstandard.ZstdCompressor(level=1).compress(b'{"text": "' + b"x" * (256 << 20) + b'"}\n')
    assert len(blob) < 100_000
    p = write(tmp_path / "run.jsonl.zst", blob)
    tracemalloc.start()
    try:
        units = plan_units([p], SourceConfig(unit_bytes=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert units == [Unit(p, 0, (256 << 20) + 13, 0)] and peak < 8 << 20


@pytest.mark.parametrize("name, body, txt_mode", [
    ("a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in ["short", "x" * 150, "y" * 200]),
     "file"),
    ("b.txt", "short\n" + "x" * 150 + "\n" + "y" * 200 + "\n", "lines"),
    ("c.txt", "short\n\n" + "x" * 150 + "\n\n" + "y" * 200 + "\n", "paragraphs"),
])
def test_a_document_over_the_limit_warns_once_per_file_where_it_is_read(tmp_path, monkeypatch,
                                                                        name, body, txt_mode):
    monkeypatch.setattr(sources, "LONG_DOCUMENT", 100)  # 64 MiB in real life
    (tmp_path / name).write_text(body)
    config = SourceConfig(txt_mode=txt_mode)
    with pytest.warns(UserWarning) as caught:
        docs = list(read_unit(Unit(str(tmp_path / name), 0, -1), config))
    assert docs == ["short", "x" * 150, "y" * 200]  # read unchanged
    assert [str(w.message) for w in caught] == [
        f"tokenmill: {tmp_path / name}: a single document of 150 characters, tokenized whole in "
        "memory (~37 tokens of a typical BPE); cut such documents into smaller ones (.txt: "
        "--txt-mode lines or paragraphs)"]


def test_a_whole_txt_file_is_not_warned_about_again_when_read(tmp_path, monkeypatch, recwarn):
    monkeypatch.setattr(sources, "LONG_DOCUMENT", 100)
    (tmp_path / "w.txt").write_text("z" * 300)  # txt_mode="file": warned about when planned
    assert list(read_unit(Unit(str(tmp_path / "w.txt"), 0, -1), SourceConfig())) == ["z" * 300]
    assert not [w for w in recwarn if "single document" in str(w.message)]
