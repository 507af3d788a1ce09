"""Fuzz the input readers with malformed JSONL, text, Parquet and Arrow files, both policies.

Failure classes: preprocessing that stalls or ends early on bad input (an exception from deep
inside a parser, a reader that stops at a bad record and drops the rest of its unit, a hang), a
partial store, and a tokenizer that chokes on what a reader lets through (lone surrogates).

The property: under ``on_error="raise"`` the only exception is an ``InputError`` naming the file
and the line, row or "file"; under ``"skip"`` nothing is raised and every ``Skip`` names the file
and place. Where the expected stream can be stated simply (JSONL, txt lines/file, Parquet, Arrow)
it is checked exactly: the documents in order, each skip at its line/row with its reason, the
error at the first bad record. Every document encodes with the byte tokenizer and a BPE (both
engines). Each example is cut into units of a random size (records straddle unit boundaries).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults.conftest import SIZE, SIZE_NAME, add, record
from tokenmill.inputs import sources
from tokenmill.base.errors import InputError, StoreError
from tokenmill.inputs.jsonl import one_value
from tokenmill.prepare import prepare
from tokenmill.inputs.records import not_text
from tokenmill.store import TokenStore, read_manifest, verify_store
from tokenmill.tokenizer import encode_documents, load_tokenizer

WHERE = re.compile(r"line \d+|row \d+ \((row group|record batch) \d+\)|file")
WS = " \t\r\f\v"
SNIFF = 8192
HANG_S = 20  # one example taking longer than this is a hang
# quick: the same examples every run (CI); soak: new ones every run
FUZZ = settings(max_examples=SIZE.fuzz_examples, deadline=None, database=None,
                derandomize=SIZE_NAME == "quick", suppress_health_check=list(HealthCheck))


class Hang(Exception):
    pass


@contextlib.contextmanager
def watchdog(seconds: float):
    """Raise Hang in this (main) thread if the block runs longer than ``seconds``."""
    def fire(*_):
        raise Hang(f"no result after {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def tokenizers(bpe_tokenizer):
    return [load_tokenizer("bytes"), load_tokenizer(bpe_tokenizer),
            load_tokenizer(bpe_tokenizer, fast=False)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# ---- generated inputs ------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
SURROGATES = st.sampled_from(["\\ud800", "\\udfff", "a\\udc00b", "\\udc00\\ud800", "x\\ud83d"])
NOT_STRINGS = st.sampled_from(["42", "null", "true", "[]", "{}", "1.5", "NaN", "-Infinity",
                               "[\"a\"]", "{\"a\": \"b\"}", "1e999"])
BAD_UTF8 = st.sampled_from([b"\xff\xfe", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80",
                            b"\xf4\x90\x80\x80", b"\xfe"])
BLANK = st.sampled_from(["", " ", "\t", "  \t ", "\f", "\v", "\r"])


@st.composite
def jsonl_line(draw) -> bytes:
    """One line of a JSONL file (without its terminator), good or bad in one of many ways."""
    kind = draw(st.sampled_from(["good", "good", "good", "extra", "surrogate", "empty",
                                 "non_string", "missing", "not_object", "truncated", "junk",
                                 "deep", "huge_int", "bad_utf8", "blank", "control", "bom",
                                 "nul", "long", "dup_key", "text_key_case"]))
    text = draw(TEXT)
    ascii_ = draw(st.booleans())
    if kind == "good":
        return json.dumps({"text": text}, ensure_ascii=ascii_).encode()
    if kind == "extra":
        return json.dumps({"id": draw(st.integers()), "text": text, "meta": {"t": [text]}},
                          ensure_ascii=ascii_).encode()
    if kind == "surrogate":
        return b'{"text": "' + draw(SURROGATES).encode() + b'"}'
    if kind == "empty":
        return b'{"text": ""}'
    if kind == "non_string":
        return b'{"text": ' + draw(NOT_STRINGS).encode() + b"}"
    if kind == "missing":
        return draw(st.sampled_from([b"{}", b'{"body": "x"}', b'{"Text": "x"}']))
    if kind == "not_object":
        return draw(st.sampled_from([b"[1, 2]", b'"text"', b"42", b"null", b"[]"]))
    if kind == "truncated":
        good = json.dumps({"text": text}, ensure_ascii=ascii_).encode()
        return good[:draw(st.integers(1, len(good) - 1))]
    if kind == "junk":
        return draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b" ")
    if kind == "deep":
        n = draw(st.sampled_from([50, 5_000]))
        return b'{"text": ' + b"[" * n + b"]" * n + b"}"
    if kind == "huge_int":
        return b'{"text": ' + b"9" * draw(st.sampled_from([4_400, 20_000])) + b"}"
    if kind == "bad_utf8":
        return b'{"text": "a' + draw(BAD_UTF8) + b'b"}'
    if kind == "blank":
        return draw(BLANK).encode()
    if kind == "control":
        return b'{"text": "a' + draw(st.sampled_from([b"\t", b"\r", b"\x1b", b"\x7f"])) + b'b"}'
    if kind == "bom":
        return b"\xef\xbb\xbf" + json.dumps({"text": text}).encode()
    if kind == "nul":
        return b'{"text": "a\x00b"}'
    if kind == "long":
        return json.dumps({"text": text * 300}).encode()
    if kind == "dup_key":
        return b'{"text": 1, "text": "' + text.encode("unicode_escape") + b'"}'
    return b'{"TEXT": "x", "text ": "y"}'


@st.composite
def jsonl_file(draw) -> bytes:
    lines = draw(st.lists(jsonl_line(), min_size=0, max_size=12))
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    data = eol.join(lines) + (eol if lines and draw(st.booleans()) else b"")
    if draw(st.integers(0, 9)) == 0:  # a byte-order mark at the very start
        data = b"\xef\xbb\xbf" + data
    return data


def file_skip(data: bytes) -> list[tuple] | None:
    """The one skip of a whole file (empty; UTF-16/32 or binary by its first SNIFF bytes: the
    rules of ``records.not_text``), or None."""
    if not data:
        return [("skip", "file", "empty_file")]
    if problem := not_text(data[:SNIFF], "f"):
        return [("skip", "file", problem[0])]
    return None


def text_lines(data: bytes) -> Iterator[tuple[str, str | None]]:
    """("line i", its text, or None if it is not UTF-8) for every "\\n"-terminated line, after a
    byte-order mark at the very start."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    for i, raw in enumerate(lines, 1):
        try:
            yield f"line {i}", raw.decode()
        except UnicodeDecodeError:
            yield f"line {i}", None


def line_oracle(data: bytes, judge: Callable[[str, str], tuple | None]) -> list[tuple]:
    """A line-based file's items: its one file skip, or line by line an invalid_utf8 skip or
    ``judge(where, line)`` (None: the line holds nothing, e.g. a blank JSONL line)."""
    if (skip := file_skip(data)) is not None:
        return skip
    items = (("skip", where, "invalid_utf8") if line is None else judge(where, line)
             for where, line in text_lines(data))
    return [item for item in items if item is not None]


def jsonl_oracle(data: bytes, key: str = "text", compressed: bool = False) -> list[tuple]:
    """What a JSONL file holds, record by record: ("doc", text) or ("skip", where, reason).
    Stated from the format, not from the reader: one JSON object per "\\n"-terminated line; a
    compressed file that is one JSON value instead (``jsonl.one_value``) is one file skip."""
    if compressed and file_skip(data) is None and one_value(data[:SNIFF], len(data) < SNIFF):
        return [("skip", "file", "malformed_json")]
    return line_oracle(data, lambda where, line: jsonl_record(where, line, key))


def jsonl_record(where: str, line: str, key: str) -> tuple | None:
    if not line.strip(WS):
        return None
    objects = []  # each object's pairs, the top-level one last
    try:
        obj = json.loads(line, object_pairs_hook=lambda pairs: objects.append(pairs) or dict(pairs))
    except (ValueError, RecursionError):
        return ("skip", where, "malformed_json")
    if not isinstance(obj, dict) or [k for k, _ in objects[-1]].count(key) > 1:  # a key twice
        return ("skip", where, "malformed_json")
    if key not in obj:
        return ("skip", where, "missing_field")
    if obj[key] == "":
        return ("skip", where, "empty_document")
    if not isinstance(obj[key], str):
        return ("skip", where, "non_string_field")
    return ("doc", obj[key])


def txt_lines_oracle(data: bytes) -> list[tuple]:
    def judge(where: str, line: str) -> tuple:
        line = line[:-1] if line.endswith("\r") else line
        return ("doc", line) if line else ("skip", where, "empty_document")
    return line_oracle(data, judge)


def txt_file_oracle(data: bytes) -> list[tuple]:
    if (skip := file_skip(data)) is not None:
        return skip
    try:
        return [("doc", data.decode())]
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return [("skip", f"line {line}", "invalid_utf8")]


@st.composite
def txt_file(draw) -> bytes:
    parts = draw(st.lists(st.one_of(
        TEXT.map(lambda t: t.encode()), BAD_UTF8, BLANK.map(str.encode),
        st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\xef\xbb\xbf", b"\0", b"\x85", b"\xe2\x80\xa8"]),
        st.binary(max_size=8)), max_size=25))
    return b"".join(parts)


COLUMN_TYPES = ["string", "large_string", "dictionary", "binary", "int64", "null", "list",
                "missing"]


@st.composite
def table(draw) -> tuple[pa.Table, str, int]:
    """A table whose "text" column is of some type, with None, "" and texts; and a group size."""
    kind = draw(st.sampled_from(COLUMN_TYPES[:3] * 3 + COLUMN_TYPES[3:]))
    values = draw(st.lists(st.one_of(TEXT, st.just(""), st.none()), max_size=30))
    n = len(values)
    if kind in ("string", "large_string"):
        col = pa.array(values, type=getattr(pa, kind)())
    elif kind == "dictionary":
        col = pa.array(values, type=pa.string()).dictionary_encode()
    elif kind == "binary":
        col = pa.array([None if v is None else v.encode() for v in values], type=pa.binary())
    elif kind == "int64":
        col = pa.array(list(range(n)), type=pa.int64())
    elif kind == "null":
        col = pa.nulls(n)
    elif kind == "list":
        col = pa.array([[v] for v in values], type=pa.list_(pa.string()))
    else:
        return pa.table({"body": pa.array(values, type=pa.string())}), kind, draw(st.integers(1, 8))
    return pa.table({"id": pa.array(range(n), pa.int64()), "text": col}), kind, draw(st.integers(1, 8))


def table_oracle(t: pa.Table, kind: str, fmt: str) -> list[tuple]:
    column = None if kind in ("string", "large_string", "dictionary") else (
        "missing_field" if kind == "missing" else "non_string_field")
    if t.num_rows == 0 and not (fmt == "arrow" and column):  # arrow: the schema is read first
        return [("skip", "file", "empty_file")]
    if column:
        return [("skip", "file", column)]
    out = []
    for i, v in enumerate(t.column("text").to_pylist(), 1):
        out.append(("doc", v) if v else ("skip", f"row {i}", "empty_document" if v == "" else
                                          "non_string_field"))
    return out


# ---- running the readers ---------------------------------------------------------------------

def read_all(path: Path, config: sources.SourceConfig) -> tuple[list, InputError | None]:
    """Every unit's items in order, as tuples like the oracles'; and the InputError, if any.
    Anything but an InputError fails the test right here."""
    items: list[tuple] = []
    try:
        units = sources.plan_units([str(path)], config)  # compressed units: with payloads, as prepare
        for unit, payload in zip(units, sources.unit_payloads(units, 0, config)):
            for x in sources.read_unit(unit, config, payload):
                if isinstance(x, sources.Skip):
                    assert x.path == str(path) and WHERE.fullmatch(x.where), x
                    assert x.reason in sources.REASONS, x
                    items.append(("skip", x.where, x.reason))
                else:
                    assert type(x) is sources.Doc and type(x.text) is str and x.text, repr(x)
                    items.append(("doc", x.text))
    except InputError as e:
        assert e.path == str(path) and e.where and WHERE.fullmatch(e.where), (e, e.path, e.where)
        assert str(path) in str(e), e
        return items, e
    return items, None


def plain(items: list[tuple]) -> list[tuple]:
    """Oracle skips carry "row N"; readers say "row N (row group G)": compare the row only."""
    return [(t[0], t[1].split(" (")[0], t[2]) if t[0] == "skip" else t for t in items]


def check(path: Path, want: list[tuple] | None, tokenizers, **config) -> None:
    """Both policies on one file: exact against ``want`` when given, else the type property;
    every document goes through every tokenizer."""
    # tiny units, but at most ~300 of them: every unit opens the file and sniffs 8 KiB
    unit_bytes = max(config.pop("unit_bytes", 1 << 20), path.stat().st_size // 300)
    with watchdog(HANG_S):
        skip_items, err = read_all(path, sources.SourceConfig(on_error="skip", unit_bytes=unit_bytes,
                                                               **config))
        assert err is None, f"on_error='skip' raised {err!r}"
        raise_items, err = read_all(path, sources.SourceConfig(on_error="raise",
                                                                unit_bytes=unit_bytes, **config))
        docs = [x[1] for x in skip_items if x[0] == "doc"]
        for tok in tokenizers:
            _, lengths = encode_documents(tok, docs)
            assert len(lengths) == len(docs) and (lengths > 0).all()
    if want is not None:
        assert plain(skip_items) == plain(want)
        first_bad = next((i for i, x in enumerate(want)
                          if x[0] == "skip" and x[2] != "empty_document"), None)
        if first_bad is None:
            assert err is None and plain(raise_items) == plain(want)
        else:
            assert err is not None and plain(raise_items) == plain(want[:first_bad])
            assert (err.where.split(" (")[0], err.reason) == plain(want)[first_bad][1:]
    elif err is None:
        assert raise_items == [x for x in skip_items]
    add("fuzz readers", "inputs", 1)
    add("fuzz readers", "inputs_x_policies", 2)
    add("fuzz readers", "raised_input_error", err is not None)
    add("fuzz readers", "documents", len(docs))
    add("fuzz readers", "skips", sum(x[0] == "skip" for x in skip_items))


# ---- the fuzz tests --------------------------------------------------------------------------

@FUZZ
@given(data=jsonl_file(), unit_bytes=st.sampled_from([1, 7, 64, 1 << 20]),
       compression=st.sampled_from(["", "", ".gz", ".zst"]))
def test_fuzz_jsonl_exact_stream_and_only_input_errors(workdir, tokenizers, data, unit_bytes,
                                                       compression):
    path = workdir / f"f.jsonl{compression}"
    path.write_bytes(compress(data, compression))
    check(path, jsonl_oracle(data, compressed=bool(compression)), tokenizers, unit_bytes=unit_bytes)


def compress(data: bytes, compression: str) -> bytes:
    if compression == ".gz":
        return gzip.compress(data, mtime=0)
    if compression == ".zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


@settings(FUZZ, max_examples=SIZE.fuzz_examples * 5 // 4)
@given(data=jsonl_file(), compression=st.sampled_from([".gz", ".zst"]),
       damage=st.tuples(st.integers(0, 10**6), st.integers(1, 255), st.booleans()))
def test_fuzz_damaged_compressed_jsonl_only_input_errors(workdir, tokenizers, data, compression,
                                                         damage):
    blob = bytearray(compress(data, compression))
    at, mask, cut = damage
    if cut:
        blob = blob[:at % len(blob)]
    else:
        blob[at % len(blob)] ^= mask
    path = workdir / f"d.jsonl{compression}"
    path.write_bytes(bytes(blob))
    check(path, None, tokenizers)


@settings(FUZZ, max_examples=SIZE.fuzz_examples * 5 // 4)
@given(data=txt_file(), mode=st.sampled_from(["lines", "file", "paragraphs"]),
       unit_bytes=st.sampled_from([1, 5, 32, 1 << 20]))
def test_fuzz_txt_exact_stream_and_only_input_errors(workdir, tokenizers, data, mode, unit_bytes):
    path = workdir / "t.txt"
    path.write_bytes(data)
    want = {"lines": txt_lines_oracle, "file": txt_file_oracle}.get(mode, lambda d: None)(data)
    check(path, want, tokenizers, txt_mode=mode, unit_bytes=unit_bytes)
    if mode == "paragraphs":  # units cut anywhere read like one unit
        whole, _ = read_all(path, sources.SourceConfig(txt_mode=mode, on_error="skip"))
        cut, _ = read_all(path, sources.SourceConfig(txt_mode=mode, on_error="skip",
                                                     unit_bytes=unit_bytes))
        assert cut == whole


@FUZZ
@given(t=table(), fmt=st.sampled_from(["parquet", "arrow"]), unit_bytes=st.sampled_from([1, 200, 1 << 20]))
def test_fuzz_columnar_exact_stream_and_only_input_errors(workdir, tokenizers, t, fmt, unit_bytes):
    table_, kind, group = t
    path = workdir / f"c.{fmt}"
    write_columnar(path, table_, group)
    check(path, table_oracle(table_, kind, fmt), tokenizers, unit_bytes=unit_bytes)


def write_columnar(path: Path, t: pa.Table, group: int) -> None:
    if path.suffix == ".parquet":
        pq.write_table(t, path, row_group_size=group)
        return
    with pa.ipc.new_stream(path, t.schema) as w:  # what Dataset.save_to_disk writes
        for batch in t.to_batches(max_chunksize=group):
            w.write_batch(batch)


@settings(FUZZ, max_examples=SIZE.fuzz_examples // 2)  # the slowest: pyarrow writes and reads
@given(t=table(), fmt=st.sampled_from(["parquet", "arrow"]),
       damage=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_fuzz_damaged_columnar_only_input_errors(workdir, tokenizers, t, fmt, damage, cut):
    table_, _, group = t
    path = workdir / f"x.{fmt}"
    write_columnar(path, table_, group)
    blob = bytearray(path.read_bytes())
    for at, mask in damage:
        blob[at % len(blob)] ^= mask
    if cut is not None:
        blob = blob[:cut % len(blob)]
    path.write_bytes(bytes(blob))
    check(path, None, tokenizers, unit_bytes=200)


# ---- whole prepare runs: never a partial store -------------------------------------------------

@st.composite
def input_dir(draw) -> list[tuple[str, bytes | tuple, list[tuple] | None]]:
    """1-3 input files: (name, content, oracle) — JSONL, txt (lines) or Parquet."""
    files = []
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["jsonl", "jsonl", "txt", "parquet"]))
        if kind == "jsonl":
            data = draw(jsonl_file())
            files.append((f"{i}.jsonl", data, jsonl_oracle(data)))
        elif kind == "txt":
            data = draw(txt_file())
            files.append((f"{i}.txt", data, txt_lines_oracle(data)))
        else:
            t, k, group = draw(table())
            files.append((f"{i}.parquet", (t, group), table_oracle(t, k, "parquet")))
    return files


def run_prepare(tmp: Path, files, policy: str, tokenizer: str, workers: int) -> None:
    """prepare on the files under ``policy``: a complete, verified store holding exactly the
    oracle's documents, or an InputError naming a file and place and no store that looks
    complete (no manifest, no temporary file)."""
    src, out = tmp / "in", tmp / "out"
    for d in (src, out):
        if d.exists():
            shutil.rmtree(d)
    src.mkdir(parents=True)
    want_docs = []
    for name, content, oracle in sorted(files):
        if isinstance(content, tuple):
            write_columnar(src / name, *content)
        else:
            (src / name).write_bytes(content)
        want_docs += [x[1] for x in oracle if x[0] == "doc"]
    try:
        with watchdog(HANG_S * 3):
            prepare([str(src)], out=out, tokenizer=tokenizer, workers=workers, progress=False,
                    on_error=policy, txt_mode="lines", shard_tokens=64, unit_bytes=48)
    except InputError as e:
        assert (e.path and str(src) in e.path and WHERE.fullmatch(e.where or "")) or \
            "no documents found" in str(e), e
        with pytest.raises(StoreError):
            read_manifest(out)
        assert not [p for p in out.rglob("*") if ".tmp" in p.name] if out.exists() else True
        add("fuzz prepare", f"{policy}_input_errors", 1)
        return
    assert verify_store(out) == []
    tok = load_tokenizer(tokenizer)
    with TokenStore(out) as store:
        got = [store[i].tolist() for i in range(len(store))]
    assert got == [ids.tolist() + [tok.eos_id] for ids in tok.encode_batch(want_docs)]
    add("fuzz prepare", f"{policy}_complete_stores", 1)


@settings(FUZZ, max_examples=SIZE.fuzz_prepare)
@given(files=input_dir())
def test_fuzz_prepare_never_leaves_a_partial_store(tmp_path_factory, bpe_tokenizer, files):
    tmp = tmp_path_factory.mktemp("fp", numbered=True)
    for policy in ("raise", "skip"):
        run_prepare(tmp, files, policy, bpe_tokenizer, workers=1)
    add("fuzz prepare", "inputs", 1)


@settings(FUZZ, max_examples=3)
@given(files=input_dir())
def test_fuzz_prepare_with_worker_processes_errors_cross_intact(tmp_path_factory, files):
    tmp = tmp_path_factory.mktemp("fpw", numbered=True)
    for policy in ("raise", "skip"):
        run_prepare(tmp, files, policy, "bytes", workers=2)
    add("fuzz prepare", "inputs_with_2_workers", 1)


def test_atheris_coverage_guided_fuzz_of_the_readers(tmp_path):
    """libFuzzer mutates seeds of every format (byte 0: format, byte 1: policy, txt mode, unit
    size) towards new coverage of sources/readers; any exception but an InputError with a file
    and place, or a hang, is a crash."""
    corpus, work = tmp_path / "corpus", tmp_path / "work"
    corpus.mkdir()
    work.mkdir()
    good = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in ["one", "two", "\u00e9"])
    seeds = {"jsonl": good + b'{"text": 1}\n[]\n', "jsonl.gz": gzip.compress(good, mtime=0),
             "jsonl.zst": zstandard.ZstdCompressor().compress(good),
             "txt": b"one\ntwo\n\nthree\r\n\xff\n"}
    for fmt in ("parquet", "arrow"):
        path = tmp_path / f"seed.{fmt}"
        write_columnar(path, pa.table({"text": ["a", "", None, "bc"]}), 2)
        seeds[fmt] = path.read_bytes()
    formats = ["jsonl", "jsonl.gz", "jsonl.zst", "txt", "parquet", "arrow"]
    for fmt, data in seeds.items():
        for flags in (0, 1, 2 + 8, 4 + 16 + 1):
            (corpus / f"{fmt}-{flags}").write_bytes(bytes([formats.index(fmt), flags]) + data)
    script = Path(__file__).with_name("atheris_readers.py")
    done = subprocess.run([sys.executable, str(script), str(work), str(corpus),
                           f"-runs={SIZE.atheris_runs}", "-seed=1", "-max_len=4096",
                           f"-timeout={HANG_S}", "-rss_limit_mb=4096"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = int(re.search(r"Done (\d+) runs", done.stderr).group(1))
    assert runs >= SIZE.atheris_runs
    cov = re.findall(r"cov: (\d+)", done.stderr)
    record("fuzz atheris", engine="mutation" if "engine: mutation" in done.stderr else "atheris",
           runs=runs, coverage_edges=int(cov[-1]) if cov else None,
           corpus_files=len(list(corpus.iterdir())), crashes=0, hangs=0)


def test_lone_surrogate_in_json_is_read_and_tokenized_as_u_fffd_never_a_unicode_error(
        tmp_path, bpe_tokenizer):
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python parses it into a str that UTF-8
    cannot encode. It reaches every tokenizer as U+FFFD (what tiktoken does), the same ids from
    both engines, and prepare (with worker processes) writes it like any document."""
    lines = [b'{"text": "a\\ud800b"}', b'{"text": "\\udfff"}', b'{"text": "x\\udc00\\ud800y"}',
             b'{"text": "ok \\ud83d\\ude00"}']  # the last: a valid pair, an emoji
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "s.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    docs = [x for x in sources.read_documents([str(tmp_path / "in")]) if isinstance(x, str)]
    assert docs == ["a\ud800b", "\udfff", "x\udc00\ud800y", "ok \U0001F600"]
    scrubbed = ["a\ufffdb", "\ufffd", "x\ufffd\ufffdy", "ok \U0001F600"]
    fast, slow = load_tokenizer(bpe_tokenizer), load_tokenizer(bpe_tokenizer, fast=False)
    assert [x.tolist() for x in fast.encode_batch(docs)] == \
        [x.tolist() for x in slow.encode_batch(docs)] == \
        [x.tolist() for x in slow.encode_batch(scrubbed)]
    assert [bytes(x.astype(np.uint8)) for x in load_tokenizer("bytes").encode_batch(docs)] == \
        [t.encode() for t in scrubbed]
    prepare([str(tmp_path / "in")], out=tmp_path / "out", tokenizer=bpe_tokenizer, workers=2,
            progress=False)
    with TokenStore(tmp_path / "out") as store:
        assert [store[i].tolist() for i in range(len(store))] == \
            [x.tolist() + [fast.eos_id] for x in fast.encode_batch(scrubbed)]
    record("lone surrogates", documents=len(docs), unicode_errors=0)
