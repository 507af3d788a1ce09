"""Where every row came from: prepare records each document's input file and line (or row) in a
``.src`` per shard, and ``explain`` names them — checked by reading each piece's document back from
its input, tokenizing it again and comparing with the row's tokens at the piece's offset."""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tokenmill
from tokenmill.inputs import readers
from tokenmill.load.loader import Loader
from tokenmill.load.provenance import SOURCE_UNKNOWN
from tokenmill.inputs.records import Unit, unit_lines_relative
from tokenmill.store import TokenStore
from tokenmill.store.format import SOURCES, parse_src
from tokenmill.store.verify import verify_store
from tokenmill.store.writer import StoreWriter, WriterConfig
from tokenmill.tokenizer import encode_documents, load_tokenizer

TOK = load_tokenizer("bytes")
L, B = 24, 8


def text_of(i: int, tag: str) -> str:
    """A document naming its file and number, of varied length (some span several rows)."""
    return f"<{tag}{i}>" + "".join(chr(97 + (i * 7 + k) % 26) for k in range((i * 13) % 61))


def write_inputs(d: Path) -> None:
    """JSONL with bad and blank lines, Parquet of several row groups, a .jsonl.gz, .txt files."""
    d.mkdir()
    rows = []
    for i in range(160):
        rows.append("{not json" if i % 23 == 7 else "" if i % 31 == 4 else
                    json.dumps({"text": "" if i % 37 == 11 else text_of(i, "j"), "id": i}))
    (d / "a.jsonl").write_text("\n".join(rows) + "\n")
    texts = [text_of(i, "p") if i % 17 != 3 else None for i in range(90)]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(d / "b.parquet"),
                   row_group_size=11)
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text_of(i, "g")}) + "\n" for i in range(120))
    lines = [text_of(i, "l") if i % 19 != 2 else "" for i in range(150)]
    (d / "lines.txt").write_text("\r\n".join(lines) + "\r\n")
    (d / "e.json").write_text("".join(  # JSON Lines named .json: cut in byte ranges too
        ("{bad\n" if i % 29 == 5 else json.dumps({"text": text_of(i, "e")}) + "\n")
        for i in range(140)))
    (d / "g.json").write_text(json.dumps(  # one array: .src numbers its elements
        [{"text": text_of(i, "a")} for i in range(60)], indent=1))
    with open(d / "f.csv", "w", newline="") as f:  # rows, one with a quoted newline
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerows((i, text_of(i, "c") + ("\nsecond line" if i % 9 == 4 else ""))
                    for i in range(80))


def write_paragraphs(d: Path) -> None:
    d.mkdir()
    paras = ["\n".join(text_of(10 * i + k, "q") for k in range(1 + i % 3)) for i in range(70)]
    (d / "para.txt").write_text("\n\n".join(paras) + ("\n" * 3))


def write_files(d: Path) -> None:
    d.mkdir()
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(text_of(i, "f") * (1 + i % 4))


def prepare(src: Path, out: Path, txt_mode: str, workers: int = 1, **kw) -> dict:
    return tokenmill.prepare([str(src)], out=str(out), tokenizer="bytes", txt_mode=txt_mode,
                             unit_bytes=kw.pop("unit_bytes", 300), shard_tokens=kw.pop(
                                 "shard_tokens", 1500), on_error="skip", workers=workers,
                             progress=False, **kw)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """{name: (store, txt_mode)}: mixed inputs (txt lines), paragraphs, whole files."""
    root = tmp_path_factory.mktemp("prov")
    out = {}
    for name, write, mode, workers in (("mixed", write_inputs, "lines", 2),
                                       ("paragraphs", write_paragraphs, "paragraphs", 1),
                                       ("files", write_files, "file", 1)):
        write(root / name)
        prepare(root / name, root / f"{name}-store", mode, workers, shard_tokens=600)
        out[name] = (root / f"{name}-store", mode)
    return out


def document(file: str, line: int, txt_mode: str) -> str:
    """The document that starts at ``line`` (or row) of ``file``, read back from the input."""
    if file.endswith(".parquet"):
        return pq.read_table(file).column("text")[line - 1].as_py()
    if file.endswith(".jsonl.gz"):
        return json.loads(gzip.open(file, "rt").read().split("\n")[line - 1])["text"]
    if file.endswith("g.json"):
        return json.loads(Path(file).read_text())[line - 1]["text"]
    if file.endswith((".jsonl", ".json")):
        return json.loads(Path(file).read_text().split("\n")[line - 1])["text"]
    if file.endswith(".csv"):
        with open(file, newline="") as f:
            return list(csv.DictReader(f))[line - 1]["text"]
    text = Path(file).read_bytes().decode()
    if txt_mode == "file":
        assert line == 1
        return text
    lines = [s[:-1] if s.endswith("\r") else s for s in text.split("\n")]
    if txt_mode == "lines":
        return lines[line - 1]
    assert line == 1 or not lines[line - 2].strip(), "a paragraph starts after a blank line"
    end = next(i for i in range(line - 1, len(lines)) if not lines[i].strip())
    return "\n".join(lines[line - 1:end])


def check_rows(store: Path, txt_mode: str, layout: str, steps=(0, 1, 5, 11)) -> set[str]:
    """Every piece of every row of a few steps is its document's tokens, re-read from its
    input; returns the input files named."""
    named = set()
    with Loader(str(store), seq_len=L, batch_size=B, layout=layout, seed=3,
                num_workers=0) as ld:
        for step in steps:
            batch = ld.batch_at(step * B)
            for o in ld.explain(step):
                row = np.append(batch["inputs"][o.row], batch["targets"][o.row][-1])
                got = []
                for p in o.pieces:
                    assert p.file is not None and os.path.isabs(p.file), p
                    kind = (" row " if p.file.endswith((".parquet", ".csv")) else
                            " element " if p.file.endswith("g.json") else ":")
                    assert p.source == f"{p.file}{kind}{p.line}"
                    ids, _ = encode_documents(TOK, [document(p.file, p.line, txt_mode)])
                    got.append(ids[p.token_offset:p.token_offset + p.tokens])
                    assert len(got[-1]) == p.tokens, p
                    named.add(os.path.basename(p.file))
                got = np.concatenate(got)
                assert np.array_equal(got, row[:len(got)]), (step, o)
    return named


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_every_piece_is_its_source_line_tokenized_again(stores, layout):
    named = check_rows(*stores["mixed"], layout, steps=range(0, 40, 3))
    assert named == {"a.jsonl", "b.parquet", "c.jsonl.gz", "lines.txt", "e.json", "f.csv",
                     "g.json"}
    assert check_rows(*stores["paragraphs"], layout) == {"para.txt"}
    assert len(check_rows(*stores["files"], layout)) > 1


def test_every_document_of_the_store_has_its_origin(stores):
    """Not only sampled rows: every document of every shard, across units and shards."""
    for store, mode in stores.values():
        manifest = json.loads((store / "manifest.json").read_text())
        assert len(manifest["shards"]) > 1 and verify_store(store) == []
        with TokenStore(store) as st:
            d = 0
            for s in manifest["shards"]:
                origins = parse_src((store / f"{s['name']}.src").read_bytes(), "x")
                for f, line in zip(origins.files.tolist(), origins.lines.tolist()):
                    text = document(manifest[SOURCES][f], line, mode)
                    want, _ = encode_documents(TOK, [text])
                    assert np.array_equal(st[d], want), (s["name"], line)
                    d += 1
            assert d == manifest["num_documents"]


def test_line_bases_add_up_and_a_resume_counts_once(tmp_path):
    """Units past byte 0 number lines from their first record; LineBases makes them the file's,
    in order or starting at any unit (a resume), even for units inside one long line."""
    body = "".join("x" * (200 if i % 9 == 4 else i % 5) + "\n" for i in range(80))
    path = tmp_path / "t.txt"
    path.write_text(body)
    config = readers.SourceConfig(unit_bytes=17, txt_mode="lines", on_error="skip")
    units = tokenmill.inputs.sources.plan_units([str(path)], config)
    want = [i + 1 for i in range(80) if i % 5 or i % 9 == 4]

    def lines_from(first: int) -> list[int]:
        bases, out = readers.LineBases(units), []
        for u in range(first, len(units)):
            count = readers.LineCount()
            docs = [d for d in tokenmill.inputs.sources.read_unit(units[u], config, None, count)
                    if isinstance(d, tokenmill.inputs.sources.Doc)]
            out += bases.absolute(u, np.array([d.line for d in docs], np.int64),
                                  count.newlines).tolist()
        return out
    assert lines_from(0) == want
    for first in range(1, len(units)):
        tail = lines_from(first)
        assert tail == want[len(want) - len(tail):], first
    assert readers.lines_before(Unit(str(path), 0, 5)) == 0


def test_a_resumed_prepare_writes_the_same_sidecars(tmp_path, monkeypatch):
    write_inputs(tmp_path / "in")
    whole = prepare(tmp_path / "in", tmp_path / "whole", "lines", unit_bytes=250, shard_tokens=700)
    real, calls = StoreWriter.commit, []

    def commit_then_die(self, info, cursor, **kw):
        real(self, info, cursor, **kw)
        calls.append(tuple(cursor))
        if len(calls) == 5:
            raise KeyboardInterrupt  # as a kill would: committed shards stay, the rest goes
    monkeypatch.setattr(StoreWriter, "commit", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "in", tmp_path / "resumed", "lines", unit_bytes=250, shard_tokens=700)
    units = tokenmill.inputs.sources.plan_units(
        sorted(str(p) for p in (tmp_path / "in").iterdir()),
        readers.SourceConfig(unit_bytes=250, txt_mode="lines"))
    u, d = calls[-1]
    assert d > 0 and unit_lines_relative(units[u]), "resumes inside a unit past the file's first"
    monkeypatch.setattr(StoreWriter, "commit", real)
    again = prepare(tmp_path / "in", tmp_path / "resumed", "lines", unit_bytes=250,
                    shard_tokens=700)
    assert again == whole
    for s in whole["shards"]:
        for ext in (".bin", ".idx", ".src"):
            name = f"{s['name']}{ext}"
            assert (tmp_path / "resumed" / name).read_bytes() == \
                (tmp_path / "whole" / name).read_bytes(), name


def test_a_store_without_sidecars_says_source_unknown(stores, tmp_path):
    store = tmp_path / "no-src"
    shutil.copytree(stores["mixed"][0], store)
    for f in store.glob("*.src"):
        f.unlink()
    with Loader(str(store), seq_len=L, batch_size=B, seed=3, num_workers=0) as ld:
        pieces = [p for o in ld.explain(2) for p in o.pieces]
    assert pieces and all(p.source.startswith(SOURCE_UNKNOWN) and p.file is None for p in pieces)
    # a store of the older format: no .src, no "sources" (its writer records no origins)
    old = tmp_path / "old"
    w = StoreWriter(old, WriterConfig(dtype="uint16", shard_tokens=50, key={"settings": {}}))
    ids, lengths = encode_documents(TOK, [text_of(i, "o") for i in range(40)])
    w.add(0, 0, ids, lengths)
    manifest = w.finish(TOK.identity(), {})
    assert SOURCES not in manifest and "src_xxh3" not in manifest["shards"][0]
    assert not list(old.glob("*.src")) and verify_store(old) == []
    with Loader(str(old), seq_len=L, batch_size=B, seed=3, num_workers=0) as ld:
        assert {p.source for o in ld.explain(0) for p in o.pieces} == {SOURCE_UNKNOWN}


def test_verify_names_a_damaged_sidecar(stores, tmp_path):
    store = tmp_path / "damaged"
    shutil.copytree(stores["mixed"][0], store)
    f = store / "shard-00001.src"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    problems = verify_store(store)
    assert len(problems) == 1 and "shard-00001.src: checksum mismatch" in problems[0]
    with Loader(str(store), seq_len=L, batch_size=B, seed=3, num_workers=0) as ld:
        for step in range(6):  # explain still works; that shard's pieces say why they are unknown
            for o in ld.explain(step):
                for p in o.pieces:
                    assert (p.file is None) == (p.shard == 1), p


MEGATRON = r"""
import sys, warnings, json
warnings.filterwarnings("ignore")
import logging; logging.disable(logging.CRITICAL)
from megatron.core.datasets.indexed_dataset import IndexedDataset
ds = IndexedDataset(sys.argv[1])
print(json.dumps([ds[i].tolist() for i in range(len(ds))]))
"""


def test_cli_explain_names_file_and_line_and_megatron_still_reads_the_shard(stores):
    store = stores["mixed"][0]
    env = {**os.environ, "PYTHONPATH": str(Path(tokenmill.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-m", "tokenmill", "explain", str(store), "--step", "3",
                          "--seq-len", str(L), "--batch-size", str(B), "--seed", "3",
                          "--layout", "concat", "--world-size", "1"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    with Loader(str(store), seq_len=L, batch_size=B, seed=3, num_workers=0) as ld:
        want = [p.source for o in ld.explain(3) for p in o.pieces]
    assert len(rows) == len(want) and all(r.endswith(f"  {s}") for r, s in zip(rows, want))
    assert any(".jsonl:" in r or ".parquet row " in r for r in rows)
    if importlib_util_find("megatron.core"):
        got = subprocess.run([sys.executable, "-c", MEGATRON, str(store / "shard-00000")],
                             capture_output=True, text=True, env=env, timeout=120)
        assert got.returncode == 0, got.stderr
        with TokenStore(store) as st:
            n = json.loads((store / "manifest.json").read_text())["shards"][0]["num_documents"]
            assert json.loads(got.stdout) == [st[d].tolist() for d in range(n)]


def importlib_util_find(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name.split(".")[0]) is not None and \
        importlib.util.find_spec(name) is not None
