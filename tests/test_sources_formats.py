"""Inputs as users have them: .json (JSON Lines or one array), .csv / .tsv with a column,
hf://datasets/… URLs, and folders holding several splits (a DatasetDict, a Hub dataset) that need
--split. Each is prepared end to end by the real `tokenmill prepare` command (tokenizer "bytes")
and the store read back is compared with the input texts."""

import csv
import importlib
import json
import os
import subprocess
import sys
import tracemalloc
from functools import partial
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.inputs import splits, tabular
from tokenmill.base.errors import InputError
from tokenmill.inputs.records import Doc, problem
from tokenmill.inputs.sources import SourceConfig, Skip, list_inputs, plan_units, read_documents, read_unit
from tokenmill.store import TokenStore

TOKENMILL = Path(sys.executable).with_name("tokenmill")
# documents that break naive readers: a delimiter, quotes, newlines (LF and CRLF), a tab,
# non-ASCII; document i names its own position
TEXTS = [f"doc {i}: a, \"quoted\" b\nsecond line\r\nthird\twith tab é✓ 🚀" if i % 3 == 0
         else f"doc {i} plain" for i in range(40)]


def prepare(*args, cwd, env=None) -> subprocess.CompletedProcess:
    """`tokenmill prepare ARGS --tokenizer bytes` as a user runs it."""
    return subprocess.run([str(TOKENMILL), "prepare", *map(str, args), "--tokenizer", "bytes"],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def store_texts(path) -> list[str]:
    """The documents of a bytes-tokenizer store, decoded (each ends with EOS 256)."""
    with TokenStore(path) as store:
        docs = [store[i].tolist() for i in range(len(store))]
    assert all(d[-1] == 256 for d in docs)
    return [bytes(d[:-1]).decode() for d in docs]


def prepared(*args, cwd, env=None) -> list[str]:
    """The documents of the store `tokenmill prepare ARGS --out store` makes (which must succeed)."""
    out = Path(cwd) / "store"
    args = args if "--workers" in args else (*args, "--workers", 1)  # one process: faster here
    proc = prepare(*args, "--out", out, "--overwrite", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return store_texts(out)


def refused(*args, cwd, env=None) -> str:
    """stderr of a prepare that must fail as a user error (exit 2, one line, no traceback)."""
    proc = prepare(*args, "--out", Path(cwd) / "refused", cwd=cwd, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("tokenmill prepare: error: ")
    return proc.stderr


def write_csv(path, texts, *, delimiter=",", key="text", bom=False, lineterminator="\r\n") -> Path:
    """A CSV/TSV as Excel and pandas write them: a header, an id column first, quoted as needed."""
    with open(path, "w", encoding="utf-8-sig" if bom else "utf-8", newline="") as f:
        w = csv.writer(f, delimiter=delimiter, lineterminator=lineterminator)
        w.writerow(["id", key, "source"])
        w.writerows([i, t, "test"] for i, t in enumerate(texts))
    return path


# ---- .json -----------------------------------------------------------------------------------

def test_json_lines_named_json_is_cut_in_ranges_and_prepared(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    config = SourceConfig(unit_bytes=256)
    units = plan_units([str(path)], config)
    assert len(units) > 5  # byte ranges, read in parallel like a .jsonl
    assert [d.text for u in units for d in read_unit(u, config)] == TEXTS
    assert prepared(path, "--workers", 2, cwd=tmp_path) == TEXTS


def test_compressed_json_is_json_lines(tmp_path):
    import gzip
    path = tmp_path / "c4-train.00000-of-01024.json.gz"  # C4's names
    path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()))
    assert prepared(path, cwd=tmp_path) == TEXTS


def test_json_array_is_one_unit_read_element_by_element(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"id": i, "text": t} for i, t in enumerate(TEXTS)], indent=2,
                               ensure_ascii=False))
    assert len(plan_units([str(path)], SourceConfig(unit_bytes=256))) == 1
    assert prepared(path, cwd=tmp_path) == TEXTS
    path.write_bytes(b"\xef\xbb\xbf \n " + json.dumps([{"text": "a"}, {"text": "b"}]).encode())
    assert list(read_documents(str(path))) == ["a", "b"]  # a byte-order mark, leading space


def test_json_array_errors_name_the_element(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"body": "c"}, {"text": 7},
                                {"text": "e"}]))
    err = refused(path, cwd=tmp_path)
    assert f"{path}, element 3: missing field (no 'text' key; keys are 'body'; its text may be under --text-key body)" in err, err
    got = list(read_documents(str(path), SourceConfig(on_error="skip")))
    assert got == ["a", "b", Skip(str(path), "element 3", "missing_field", "no 'text' key; keys are 'body'; its text may be under --text-key body"),
                   Skip(str(path), "element 4", "non_string_field", "'text' is a number"), "e"]
    # a malformed element is skipped, counted, and the elements after it are read
    path.write_text('[{"text": "a"}, {"text": },\n {"text": "c"}, {"text": "d" "x"}, tru, {"text": "f"}]')
    got = list(read_documents(str(path), SourceConfig(on_error="skip")))
    assert got == ["a", Skip(str(path), "element 2", "malformed_json",
                             "Expecting value at character 10 of the element, byte 25 of the file"),
                   "c", Skip(str(path), "element 4", "malformed_json",
                             "Expecting ',' delimiter at character 14 of the element, byte 57 of the file"),
                   Skip(str(path), "element 5", "malformed_json",
                        "Expecting value at character 1 of the element, byte 63 of the file"), "f"]
    path.write_text('[{"text": "a"}')
    assert [getattr(x, "detail", x) for x in read_documents(str(path), SourceConfig(on_error="skip"))] == [
        "a", "the array is not closed (the file ends)"]
    path.write_text('[{"text": "a"}, {"text": "b')  # cut inside an element: that one skipped
    assert [getattr(x, "where", x) for x in read_documents(str(path), SourceConfig(on_error="skip"))] == [
        "a", "element 2"]


def test_a_bad_json_array_element_under_skip_is_counted_and_the_rest_prepared(tmp_path):
    elements = [json.dumps({"text": t}) for t in TEXTS]
    for i in (3, 4, 17, 39):  # malformed, each on its own: the rest must still be read
        elements[i] = ['{"text": }', '{"text": "a" "b"}', "{'text': 'single quotes'}", 'tru'][i % 4]
    path = tmp_path / "data.json"
    path.write_text("[\n" + ",\n".join(elements) + "\n]\n")
    want = [t for i, t in enumerate(TEXTS) if i not in (3, 4, 17, 39)]
    assert prepared(path, "--on-error", "skip", cwd=tmp_path) == want
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert (manifest["num_documents"], manifest["skipped"]["by_reason"]) == (36, {"malformed_json": 4})
    assert [e["where"] for e in manifest["skipped"]["examples"]] == [
        "element 4", "element 5", "element 18", "element 40"]
    err = refused(path, cwd=tmp_path)
    assert f"{path}, element 4: malformed JSON (Expecting" in err and ", byte " in err, err


@pytest.mark.parametrize("text,where", [
    ('[{"text": "a"} {"text": "b"}, {"text": "c"}]', "after element 1 (byte 15): malformed JSON "
                                                     "(expected ',' or ']', found '{')"),
    ('[{"text": "a"}, {"text": "b"], {"text": "c"}]', "element 2 (byte 28): malformed JSON "
                                                      "(']' closes '{')"),
    ('[{"text": "a"}] [{"text": "b"}]', "after the array (byte 16): malformed JSON (text after "
                                        "its closing ']': '[')")])
def test_a_json_array_whose_elements_cannot_be_told_apart_fails_under_skip_too(tmp_path, text, where):
    path = tmp_path / "data.json"
    path.write_text(text)
    err = refused(path, "--on-error", "skip", cwd=tmp_path)
    assert f"{path}, {where}; the elements after it cannot be found, so the file cannot be read " \
           "past it (under --on-error skip too): fix the file" in err, err
    assert err.count("\n") == 1


BAD_ELEMENTS = st.sampled_from(['{"text": }', '{"text": "a" "b"}', "{'text': 'x'}", "tru",
                                '{"text": "\\q"}', "[1 2]", '{"a": [1, {"b": }]}', "+1"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.one_of(st.text(min_size=1, max_size=8).map(lambda t: {"text": t}),
                                 BAD_ELEMENTS), min_size=1, max_size=8),
       indent=st.sampled_from(["", "\n  "]), chunk=st.sampled_from([1, 2, 3, 5, 64]))
def test_json_array_malformed_elements_are_skipped_alone_at_any_read_size(tmp_path, monkeypatch,
                                                                          values, indent, chunk):
    monkeypatch.setattr(tabular, "_CHUNK", chunk)
    path = tmp_path / "a.json"
    path.write_text("[" + indent + ("," + indent).join(
        json.dumps(v) if isinstance(v, dict) else v for v in values) + "]")
    got = list(tabular.read_json_array(str(path), SourceConfig(), partial(problem, str(path), "skip")))
    assert [g if isinstance(g, Doc) else (g.where, g.reason) for g in got] == [
        Doc(v["text"], n) if isinstance(v, dict) else (f"element {n}", "malformed_json")
        for n, v in enumerate(values, 1)]


def test_a_file_tokenmill_does_not_read_is_named_for_what_it_is_with_what_to_do(tmp_path):
    import gzip
    (tmp_path / "in").mkdir()
    files = {"u16.txt": "hello\nworld\n".encode("utf-16"),  # with a byte-order mark
             "u16.csv": "text\nhello\n".encode("utf-16-le"),  # without one
             "one.json": json.dumps({"version": 1, "data": [{"text": "a"}]}, indent=2).encode(),
             "arr.json.gz": gzip.compress(json.dumps([{"text": "a"}, {"text": "b"}]).encode()),
             "fine.jsonl": b'{"text": "kept"}\n'}
    for name, data in files.items():
        (tmp_path / "in" / name).write_bytes(data)
    says = {"u16.txt": "invalid UTF-8 (UTF-16 text, little-endian with byte-order mark FF FE; "
                       "convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 {p} > {d}/u16.utf8.txt)",
            "u16.csv": "invalid UTF-8 (UTF-16 text, little-endian without a byte-order mark; "
                       "convert it to UTF-8, e.g. iconv -f UTF-16LE -t UTF-8 {p} > {d}/u16.utf8.csv)",
            "one.json": "malformed JSON (one JSON object spread over several lines, not JSON "
                        "Lines or an array of objects: a .json is read as one object per line or "
                        "as one top-level array of objects; convert it to JSON Lines, e.g. "
                        "jq -c '.KEY[]' for the records under KEY, or jq -c . for one record)",
            "arr.json.gz": "malformed JSON (a JSON array, not JSON Lines: a compressed .json is "
                           "read as JSON Lines (one object per line), an array only from a plain "
                           ".json; decompress it, or convert it with jq -c '.[]')"}
    for name, what in says.items():
        path = tmp_path / "in" / name
        err = refused(path, cwd=tmp_path)
        assert err == (f"tokenmill prepare: error: {path}: " + what.format(p=path, d=path.parent)
                       + "; fix or remove the file, or pass --on-error skip\n"), err
    assert prepared(tmp_path / "in", "--on-error", "skip", cwd=tmp_path) == ["kept"]
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {"malformed_json": 2, "invalid_utf8": 2}
    assert {(e["path"].rpartition("/")[2], e["where"]) for e in manifest["skipped"]["examples"]} == {
        (name, "file") for name in says}


def test_json_array_memory_is_one_element_not_the_file(tmp_path):
    path = tmp_path / "big.json"
    texts = [f"{i:06d} " + "x" * 20_000 for i in range(1500)]  # 30 MB
    path.write_text(json.dumps([{"text": t} for t in texts]))
    tracemalloc.start()
    try:
        n = sum(1 for t in read_documents(str(path)) if t[:6].isdigit())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 1500
    assert peak < 8 << 20, f"peak {peak:,} bytes for a {path.stat().st_size:,}-byte file"


# ---- .csv / .tsv -----------------------------------------------------------------------------

def test_csv_with_quoted_newlines_is_prepared(tmp_path):
    path = write_csv(tmp_path / "data.csv", TEXTS, bom=True)
    assert b"\nsecond line\r\nthird" in path.read_bytes()  # a quoted newline inside a field
    assert prepared(path, cwd=tmp_path) == TEXTS
    write_csv(path, TEXTS, key="content", lineterminator="\n")
    assert list(read_documents(str(path), SourceConfig(text_key="content"))) == TEXTS


def test_tsv_is_read_without_quoting_one_line_one_row(tmp_path):
    # quotes are text in a TSV (IANA; pandas sep="\t", quoting=QUOTE_NONE): a field starting
    # with '"' must not swallow the rows after it
    texts = [f'"doc {i} starts with a quote' if i % 4 == 0 else f'doc {i} says "hi" and \'bye\''
             for i in range(30)]
    lines = ["id\ttext"] + [f"{i}\t{t}" for i, t in enumerate(texts)]
    lines[8] += "\textra"  # row 8: 3 fields (a tab inside the text), counted, never glued on
    path = tmp_path / "data.tsv"
    path.write_bytes(("\r\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n").encode())
    import pandas
    want = pandas.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, on_bad_lines="skip",
                           keep_default_na=False)["text"].tolist()
    assert want == texts[:7] + texts[8:]
    assert prepared(path, "--on-error", "skip", cwd=tmp_path) == want
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert (manifest["num_documents"], manifest["skipped"]["by_reason"]) == (29, {"malformed_row": 1})
    assert [(e["where"], e["detail"]) for e in manifest["skipped"]["examples"]] == [
        ("row 8 (line 9)", "3 fields, the header has 2; a TSV field cannot hold a tab (it has no "
                           "quoting)")]
    err = refused(path, cwd=tmp_path)
    assert f"{path}, row 8 (line 9): malformed row (3 fields, the header has 2" in err, err


def test_csv_missing_column_names_the_columns(tmp_path):
    path = write_csv(tmp_path / "data.csv", TEXTS, key="body")
    err = refused(path, cwd=tmp_path)
    assert (f"{path}: missing field (no column 'text'; columns are 'id', 'body', 'source'); "
            "choose the column with --text-key") in err, err


def test_csv_naming_the_text_column_twice_is_refused_not_guessed(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("text,text\na,b\n")
    got = list(read_documents(str(path), SourceConfig(on_error="skip")))
    assert [(x.where, x.reason) for x in got] == [("file", "malformed_row")]
    assert "names column 'text' 2 times" in got[0].detail


def test_csv_bad_rows_are_skipped_by_row_and_line(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b'id,text\n1,"one\ntwo"\n2,three,extra\n\n3,\n4,bad \xff byte\n5,five\n')
    err = refused(path, cwd=tmp_path)
    assert f"{path}, row 2 (line 4): malformed row (3 fields, the header has 2" in err, err
    assert prepared(path, "--on-error", "skip", cwd=tmp_path) == ["one\ntwo", "five"]
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert [(e["where"], e["reason"]) for e in manifest["skipped"]["examples"]] == [
        ("row 2 (line 4)", "malformed_row"), ("row 3 (line 6)", "empty_document"),
        ("row 4 (line 7)", "invalid_utf8")]


def test_csv_header_only_and_binary_are_file_problems(tmp_path):
    (tmp_path / "h.csv").write_text("id,text\n")
    (tmp_path / "b.csv").write_bytes(b"text\nx\0y\n")
    got = list(read_documents([str(tmp_path / "h.csv"), str(tmp_path / "b.csv")],
                              SourceConfig(on_error="skip")))
    assert [(s.where, s.reason) for s in got] == [("file", "binary_file"), ("file", "empty_file")]


# ---- a JSON key named twice --------------------------------------------------------------------

TWICE = '{"text": "first", "text": "second"}'  # json.loads and orjson keep "second" silently
# not twice: "text" nested, or in a value (escaped quotes), or another key twice (not read)
NOT_TWICE = ['{"text": "a \\"text\\" b", "meta": {"text": "c"}}', '{"id": 1, "id": 2, "text": "d"}']


def _twice_file(tmp_path, layout: str) -> Path:
    """Record 2 of 4 names "text" twice, as JSON Lines (.jsonl, .json, .jsonl.gz) or an array."""
    import gzip
    records = [NOT_TWICE[0], TWICE, NOT_TWICE[1], '{"text": "last"}']
    if layout == "array":
        path = tmp_path / "data.json"
        path.write_text("[\n" + ",\n".join(records) + "\n]\n")
    else:
        path = tmp_path / f"data.{layout}"
        data = "".join(r + "\n" for r in records).encode()
        path.write_bytes(gzip.compress(data) if layout.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("layout", ["jsonl", "json", "jsonl.gz", "array"])
def test_a_text_key_named_twice_is_refused_or_skipped_never_one_kept(tmp_path, layout, transform):
    path = _twice_file(tmp_path, layout)
    (tmp_path / "twice_fn.py").write_text("def text(record):\n    return record['text']\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    more = ("--transform", "twice_fn:text") if transform else ()
    where = "element 2" if layout == "array" else "line 2"
    err = refused(path, *more, cwd=tmp_path, env=env)
    place = f"{path}, {where}" if layout == "array" else f"{path}:2"
    assert f"{place}: malformed JSON (key 'text' is named twice, and a JSON reader keeps one " \
           "of the two values silently: remove or rename one)" in err, err
    assert len(err.strip().splitlines()) == 1, err
    if transform:  # a transform gets the record whole: a key twice anywhere in it is refused
        for n, record in enumerate(NOT_TWICE[1:]):
            (tmp_path / f"other{n}.jsonl").write_text(record + "\n")
            err = refused(tmp_path / f"other{n}.jsonl", *more, cwd=tmp_path, env=env)
            assert "malformed JSON (key 'id' is named twice" in err, err
        return
    got = prepared(path, "--on-error", "skip", cwd=tmp_path, env=env)
    assert got == ['a "text" b', "d", "last"]
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {"malformed_json": 1}
    assert [e["where"] for e in manifest["skipped"]["examples"]] == [where]


# "text" named again with escapes, as a writer may spell it: one \u escape, all, upper-case hex
ESCAPED_TWICE = ['{"text": "AAA", "\\u0074ext": "BBB"}', '{"\\u0074\\u0065\\u0078\\u0074": "BBB", "text": "AAA"}',
                 '{"text": "AAA", "te\\u0058t": "x", "t\\u0065xt": "BBB"}']


@pytest.mark.parametrize("layout", ["jsonl", "jsonl.gz"])
def test_a_text_key_named_again_with_escapes_is_refused_or_skipped(tmp_path, layout):
    import gzip
    records = ['{"text": "caf\\u00e9 \\ud83d\\ude80"}', *ESCAPED_TWICE, '{"text": "last"}']
    data = "".join(r + "\n" for r in records).encode()
    path = tmp_path / f"data.{layout}"
    path.write_bytes(gzip.compress(data) if layout.endswith(".gz") else data)
    err = refused(path, cwd=tmp_path)
    assert f"{path}:2: malformed JSON (key 'text' is named twice" in err, err
    assert len(err.strip().splitlines()) == 1, err
    got = prepared(path, "--on-error", "skip", cwd=tmp_path)
    assert got == ["caf\u00e9 \U0001f680", "last"]  # the \u escapes of a value are read as ever
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {"malformed_json": 3}
    assert [e["where"] for e in manifest["skipped"]["examples"]] == ["line 2", "line 3", "line 4"]


def test_each_joined_text_key_named_twice_is_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"title": "t", "body": "b1", "body": "b2"}\n')
    err = refused(path, "--text-key", "title,body", cwd=tmp_path)
    assert f"{path}:1: malformed JSON (key 'body' is named twice" in err, err
    path = tmp_path / "data.json"
    path.write_text('[{"title": "t", "title": "u", "body": "b"}]')
    err = refused(path, "--text-key", "title,body", cwd=tmp_path)
    assert f"{path}, element 1: malformed JSON (key 'title' is named twice" in err, err
    (tmp_path / "ok.jsonl").write_text('{"title": "t", "body": "b", "x": 1, "x": 2}\n')
    assert prepared(tmp_path / "ok.jsonl", "--text-key", "title,body", cwd=tmp_path) == ["t\n\nb"]


# ---- folders holding several splits: DatasetDict, Hub layouts ---------------------------------

def test_dataset_dict_needs_split(tmp_path):
    import datasets  # a dev dependency
    train, val = [f"train {i}" for i in range(30)], [f"validation {i}" for i in range(7)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                          "validation": datasets.Dataset.from_dict({"text": val})}
                         ).save_to_disk(str(tmp_path / "dd"))
    err = refused(tmp_path / "dd", cwd=tmp_path)
    assert "dd: holds 2 splits (train (1 file), validation (1 file)); preparing them together" in err
    assert "pass --split NAME" in err
    assert prepared(tmp_path / "dd", "--split", "validation", cwd=tmp_path) == val
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["settings"]["split"] == "validation"
    assert prepared(tmp_path / "dd" / "train", cwd=tmp_path) == train  # a split named: as before
    listing = list_inputs(str(tmp_path / "dd"), split="train")
    assert listing.files == [str(tmp_path / "dd" / "train" / "data-00000-of-00001.arrow")]
    assert not listing.ignored  # dataset_dict.json is the dataset's own, not an input passed over
    with pytest.raises(InputError, match="no split 'test'; its splits are train "
                                         r"\(1 file\), validation \(1 file\)"):
        list_inputs(str(tmp_path / "dd"), split="test")


@pytest.mark.parametrize("relpath,split", [
    ("data/train-00000-of-00002.parquet", "train"), ("train.jsonl", "train"),
    ("default/validation/0000.parquet", "validation"), ("data/test_gen-00000-of-00001.parquet", "test_gen"),
    ("plain_text/unsupervised-00000-of-00001.parquet", None), ("en/part-0.jsonl", None),
    ("train_0.jsonl", "train"), ("mine/x.arrow", None)])
def test_file_split_of_hub_file_names(relpath, split):
    assert splits.file_split(relpath) == split


def test_file_split_of_a_dataset_dicts_own_names():
    assert splits.file_split("mine/data-00000-of-00001.arrow", {"mine"}) == "mine"
    assert splits.dict_splits(b'{"splits": ["mine", "other"]}') == ["mine", "other"]
    assert splits.dict_splits(b"not json") == splits.dict_splits(None) == []


def test_a_local_folder_of_split_files(tmp_path):
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / "corpus" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_text(json.dumps({"text": name}) + "\n")
    with pytest.raises(InputError, match=r"holds 2 splits \(test \(1 file\), train \(1 file\)\)"):
        list_inputs(str(tmp_path / "corpus"))
    assert list_inputs(str(tmp_path / "corpus"), split="test").files == [str(tmp_path / "corpus" / "test.jsonl")]
    assert len(list_inputs(f"{tmp_path}/corpus/*.jsonl").files) == 2  # a glob: taken as named


# ---- hf:// through a filesystem registered with fsspec ----------------------------------------

FAKE_HUB = '''
"""hf://datasets/ORG/NAME/... served from $FAKE_HUB_ROOT/datasets/ORG/NAME/... (no network)."""
import os
import fsspec
from fsspec.implementations.local import LocalFileSystem


class FakeHub(LocalFileSystem):
    protocol = "hf"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("hf://"):
            path = os.environ["FAKE_HUB_ROOT"] + "/" + path[len("hf://"):]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name):
        name, root = self._strip_protocol(name), os.environ["FAKE_HUB_ROOT"]
        return "hf://" + name[len(root) + 1:] if name.startswith(root + "/") else name


fsspec.register_implementation("hf", FakeHub, clobber=True)
'''


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub dataset repo, org/corpus: README, train in two parquet files, validation in one;
    hf:// served from it in this process and (through sitecustomize) in every child process."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "fakehub.py").write_text(FAKE_HUB)
    (site / "sitecustomize.py").write_text("import fakehub  # noqa\n")
    repo = tmp_path / "hub" / "datasets" / "org" / "corpus"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nconfigs: ...\n---\n")
    (repo / ".gitattributes").write_text("*.parquet filter=lfs\n")
    texts = {"train": [f"train {i}" for i in range(50)], "validation": [f"val {i}" for i in range(9)]}
    for name, part in (("train-00000-of-00002", texts["train"][:30]),
                       ("train-00001-of-00002", texts["train"][30:]),
                       ("validation-00000-of-00001", texts["validation"])):
        pq.write_table(pa.table({"text": part}), repo / "data" / f"{name}.parquet", row_group_size=7)
    env = {"FAKE_HUB_ROOT": str(tmp_path / "hub"),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(site))
    fakehub = importlib.import_module("fakehub")
    fsspec.register_implementation("hf", fakehub.FakeHub, clobber=True)  # in this process
    yield env, texts
    importlib.import_module("fsspec.registry")._registry.pop("hf", None)  # the real one again


def test_hf_dataset_lists_its_data_files_by_split(hub, tmp_path):
    _, texts = hub
    with pytest.raises(InputError, match=r"hf://datasets/org/corpus: holds 2 splits \(train \(2 files\), "
                                         r"validation \(1 file\)\)"):
        list_inputs("hf://datasets/org/corpus")
    listing = list_inputs("hf://datasets/org/corpus", split="train")
    assert listing.files == [f"hf://datasets/org/corpus/data/train-0000{i}-of-00002.parquet" for i in (0, 1)]
    assert listing.ignored.summary() == "1 .md, 1 hidden"  # README.md, .gitattributes
    assert list(read_documents("hf://datasets/org/corpus/", SourceConfig(split="validation"))) \
        == texts["validation"] == list(read_documents("hf://datasets/org/corpus/data/validation-*.parquet"))


def test_hf_url_of_a_model_repo_says_how_datasets_are_named(hub):
    with pytest.raises(InputError, match=r"hf://org/corpus: no file matched \(not found; a Hub "
                                         r"dataset is hf://datasets/ORG/NAME\)"):
        list_inputs("hf://org/corpus")


def test_hf_dataset_prepared_through_the_cli(hub, tmp_path):
    env, texts = hub
    url = "hf://datasets/org/corpus"
    assert "holds 2 splits" in refused(url, cwd=tmp_path, env=env)
    assert prepared(url, "--split", "train", "--workers", 2, cwd=tmp_path, env=env) == texts["train"]
    one = f"{url}/data/train-00001-of-00002.parquet"
    assert prepared(one, cwd=tmp_path, env=env) == texts["train"][30:]


def test_hf_url_without_huggingface_hub_says_what_to_install(tmp_path):
    script = tmp_path / "nohub.py"  # a script without a __main__ guard, as users write them
    script.write_text("import sys\nsys.modules['huggingface_hub'] = None\n"
                      "from tokenmill.inputs.sources import list_inputs\n"
                      "try:\n    list_inputs('hf://datasets/org/name')\n"
                      "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60).stdout
    assert out.startswith("ConfigError hf://datasets/org/name: cannot open (") and \
        out.rstrip().endswith("; pip install huggingface_hub"), out


def test_csv_rows_and_lines_are_exact_across_read_blocks(tmp_path):
    # 1 MiB reads: quoted fields cross their edges; "\x0c" and "\u2028" are not line ends in CSV
    texts = [f"{i} " + ("line\n" * (i % 7)) + "x" * (i * 9) + " \x0c \u2028 end" for i in range(700)]
    path = write_csv(tmp_path / "big.csv", texts, lineterminator="\n")
    data = path.read_bytes()
    assert len(data) > 2 << 20
    bad_at = data.index(b"699 ")  # the last row's text: a byte that is not UTF-8 in it
    path.write_bytes(data[:bad_at] + b"\xff" + data[bad_at:])
    got = list(read_documents(str(path), SourceConfig(on_error="skip")))
    assert got[:-1] == texts[:-1]
    line = 2 + sum(t.count("\n") + 1 for t in texts[:-1])  # the header, then each row's lines
    assert (got[-1].where, got[-1].reason) == (f"row 700 (line {line})", "invalid_utf8")


def test_csv_quoting_is_strict(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('text\nok\n"a"b\nfine\n"open\nto the end\n')
    got = list(read_documents(str(path), SourceConfig(on_error="skip")))
    assert [x if isinstance(x, str) else (x.where, x.reason, x.detail) for x in got] == [
        "ok", ("row 2 (line 3)", "malformed_row",
               "',' expected after '\"'; a quote inside a quoted field is written twice (\"\")"),
        "fine", ("row 4 (line 5)", "malformed_row",
                 "a quoted field is not closed before the end of the file")]
    path.write_bytes(b"text\rone\rtwo\r")  # classic Mac line ends
    assert [(x.where, x.reason) for x in read_documents(str(path), SourceConfig(on_error="skip"))] == [
        ("file", "malformed_row")]


def test_hf_csv_and_json_array_read_through_fsspec(hub, tmp_path):
    repo = tmp_path / "hub" / "datasets" / "org" / "tables"
    repo.mkdir(parents=True)
    write_csv(repo / "a.csv", TEXTS[:20])
    (repo / "b.json").write_text(json.dumps([{"text": t} for t in TEXTS[20:]]))
    assert list(read_documents("hf://datasets/org/tables")) == TEXTS


# ---- properties: any read size gives the same documents --------------------------------------

ELEMENT = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
                       | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3), max_leaves=5)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.one_of(st.text(min_size=1, max_size=8).map(lambda t: {"text": t}), ELEMENT),
                       max_size=8),
       indent=st.sampled_from([None, 0, 2]), bom=st.booleans(), chunk=st.sampled_from([1, 2, 3, 5, 64]))
def test_json_array_reads_the_same_at_any_read_size(tmp_path, monkeypatch, values, indent, bom, chunk):
    monkeypatch.setattr(tabular, "_CHUNK", chunk)
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf" * bom + json.dumps(values, indent=indent).encode())
    got = list(tabular.read_json_array(str(path), SourceConfig(), partial(problem, str(path), "skip")))
    want = [Doc(v["text"], n) if isinstance(v, dict) else ("element", n)
            for n, v in enumerate(values, 1)] or [("file", None)]  # [] is an empty file
    assert [g if isinstance(g, Doc) else (g.where.split()[0], int(g.where.split()[1]))
            if g.where != "file" else ("file", None) for g in got] == want


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=12),
                      min_size=1, max_size=8),
       delimiter=st.sampled_from([",", "\t"]), eol=st.sampled_from(["\n", "\r\n"]),
       chunk=st.sampled_from([1, 2, 3, 5, 64]))
def test_csv_reads_the_same_at_any_read_size(tmp_path, monkeypatch, texts, delimiter, eol, chunk):
    monkeypatch.setattr(tabular, "_CHUNK", chunk)
    texts = [t.replace("\r", "\n").replace("\0", " ") for t in texts]  # csv.writer writes "\r" bare
    fmt = "tsv" if delimiter == "\t" else "csv"
    if fmt == "csv":
        path = write_csv(tmp_path / "a.csv", texts, lineterminator=eol)
    else:  # no quoting: a field holds neither tab nor newline, and is written as it is
        texts = [t.replace("\t", " ").replace("\n", " ") for t in texts]
        path = tmp_path / "a.tsv"
        path.write_text("".join(f"{i}\t{t}\ttest{eol}" for i, t in
                                enumerate(["text", *texts], -1)).replace("-1\ttext\ttest", "id\ttext\tsource"),
                        encoding="utf-8", newline="")
    got = list(tabular.read_csv(str(path), fmt, SourceConfig(), partial(problem, str(path), "skip")))
    assert got == [Doc(t, n) for n, t in enumerate(texts, 1)]  # rows numbered after the header
