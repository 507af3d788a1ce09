"""The store format: writer, memory-mapped reader, an independent reader, verify."""

import json
import struct

import numpy as np
import pytest

from tokenmill.errors import StoreError
from tokenmill.store import (ShardWriter, TokenStore, atomic_write_json, build_manifest,
                             read_idx, verify_store)


def write_store(path, docs, *, dtype=np.uint16, shard_tokens=50):
    """A store of the given documents (lists of ids), without a tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    w = ShardWriter(path, dtype=dtype, shard_tokens=shard_tokens)
    shards = []
    for doc in docs:  # one add per document, and one add of everything, must agree (tested below)
        shards += [info for info, _ in w.add(np.asarray(doc, dtype), np.array([len(doc)]))]
    if (last := w.finish()) is not None:
        shards.append(last)
    manifest = build_manifest(tokenizer={"kind": "test", "vocab_size": 65000}, dtype=dtype,
                              shards=shards, settings={}, skipped={"total": 0})
    atomic_write_json(path / "manifest.json", manifest)
    return manifest


def positional_docs(lengths):
    """Documents whose token i is its global position (mod 60000): any reorder or drop shows."""
    docs, pos = [], 0
    for n in lengths:
        docs.append([(pos + i) % 60000 for i in range(n)])
        pos += n
    return docs


def independent_read(prefix):
    """Read a shard from the byte layout alone (design.md), without tokenmill's reader."""
    raw = open(f"{prefix}.idx", "rb").read()
    magic, version, code, n, m = struct.unpack_from("<9sQBQQ", raw, 0)
    assert magic == b"MMIDIDX\x00\x00" and version == 1
    dtype = {4: np.int32, 8: np.uint16}[code]
    off = 34
    lengths = np.frombuffer(raw, "<i4", n, off)
    pointers = np.frombuffer(raw, "<i8", n, off + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", m, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * m
    data = open(f"{prefix}.bin", "rb").read()
    itemsize = np.dtype(dtype).itemsize
    docs = [np.frombuffer(data, dtype, int(ln), int(p)).tolist() for ln, p in zip(lengths, pointers)]
    return docs, doc_idx.tolist()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_shards_read_back_by_independent_reader(tmp_path, dtype):
    lengths = [7, 1, 30, 45, 2, 60, 3, 9, 11]
    docs = positional_docs(lengths)
    manifest = write_store(tmp_path, docs, dtype=dtype, shard_tokens=50)
    got, boundaries = [], []
    for s in manifest["shards"]:
        d, idx = independent_read(tmp_path / s["name"])
        got += d
        assert idx == list(range(len(d) + 1))
    assert got == docs
    # a shard closes at the first document boundary at or past 50 tokens
    assert [s["num_tokens"] for s in manifest["shards"]] == [83, 62, 23]


def test_token_store_api(tmp_path):
    lengths = [5, 17, 1, 40, 33, 8, 21]
    docs = positional_docs(lengths)
    write_store(tmp_path, docs, shard_tokens=30)
    with TokenStore(tmp_path) as store:
        assert len(store) == len(docs)
        assert store.num_tokens == sum(lengths)
        assert store.num_shards > 2
        assert store.doc_lengths.tolist() == lengths
        assert store.doc_starts.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        for i, doc in enumerate(docs):
            assert store[i].tolist() == doc
            assert isinstance(store[i].base, np.memmap) or isinstance(store[i].base.base, np.memmap)
            assert not store[i].flags.owndata and not store[i].flags.writeable  # zero-copy view
        assert store[-1].tolist() == docs[-1]
        flat = [t for d in docs for t in d]
        for a, b in [(0, 125), (3, 60), (22, 23), (40, 100), (0, 0), (124, 125)]:
            assert store.tokens(a, b).tolist() == flat[a:b]
            out = np.empty(b - a, np.int64)
            store.copy_tokens(a, out)
            assert out.tolist() == flat[a:b]
        with pytest.raises(IndexError):
            store.tokens(0, 126)
        with pytest.raises(IndexError):
            store[len(docs)]


def test_writer_cursor_counts_documents_of_each_add(tmp_path):
    w = ShardWriter(tmp_path, dtype=np.uint16, shard_tokens=10)
    toks = np.arange(30, dtype=np.uint16)
    closed = w.add(toks, np.array([4, 4, 4, 4, 4, 10]))
    # shard 0: docs 0-2 (12 tokens); shard 1: docs 3-4 (8) + doc 5 (10) = 18
    assert [(i.num_documents, n) for i, n in closed] == [(3, 3), (3, 6)]
    assert w.finish() is None


def test_refuses_missing_manifest_and_wrong_version(tmp_path):
    write_store(tmp_path, positional_docs([3, 4]))
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(StoreError, match="prepare did not finish"):
        TokenStore(tmp_path)
    m["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="version 99"):
        TokenStore(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "tokenmill-st')
    with pytest.raises(StoreError, match="not valid JSON"):
        TokenStore(tmp_path)


def test_refuses_size_mismatch_naming_file(tmp_path):
    write_store(tmp_path, positional_docs([30, 30, 30]), shard_tokens=40)
    with open(tmp_path / "shard-00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(StoreError, match=r"shard-00001\.bin: expected 60 bytes, found 10"):
        TokenStore(tmp_path)


def test_verify_finds_flipped_byte_and_truncation(tmp_path):
    write_store(tmp_path, positional_docs([30, 30, 30]), shard_tokens=40)
    assert verify_store(tmp_path) == []
    with open(tmp_path / "shard-00000.bin", "r+b") as f:
        f.seek(17)
        b = f.read(1)
        f.seek(17)
        f.write(bytes([b[0] ^ 0x01]))
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and "shard-00000.bin: checksum mismatch" in problems[0]
    with open(tmp_path / "shard-00001.idx", "r+b") as f:
        f.truncate(30)
    problems = verify_store(tmp_path)
    assert any("shard-00001.idx: expected" in p for p in problems)


def test_read_idx_rejects_garbage(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(StoreError, match="magic"):
        read_idx(tmp_path / "x.idx")
    (tmp_path / "y.idx").write_bytes(b"MMI")
    with pytest.raises(StoreError, match="too short"):
        read_idx(tmp_path / "y.idx")
