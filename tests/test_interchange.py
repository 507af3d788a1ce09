"""interchange: Megatron-LM datasets in (checked against Megatron's own reader and writer when
megatron-core is installed, and against the byte layout always), nanoGPT / JSONL out."""

import errno
import importlib.util
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import docs_of, store_bytes, write_jsonl, write_positional_store
from tokenmill import interchange
from tokenmill.cli import main
from tokenmill.base.errors import ConfigError, InputError, StoreError, TokenizerError
from tokenmill.interchange import export, import_megatron
from tokenmill.load.loader import Loader
from tokenmill.prepare import prepare
from tokenmill.store import TokenStore, verify_store

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None


def write_megatron(prefix, sequences, doc_idx, *, dtype=np.uint16, code=None, modes=False) -> str:
    """A Megatron indexed dataset written from the byte layout (design.md), without tokenmill."""
    dtype = np.dtype(dtype)
    code = code or {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.int64): 5}[dtype]
    lengths = np.array([len(s) for s in sequences], "<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * dtype.itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype.newbyteorder("<")).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, len(lengths), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype("<i8").tobytes()
                + np.asarray(doc_idx, "<i8").tobytes())
        if modes:
            f.write(bytes(len(lengths)))
    return str(prefix)


def split(doc: list[int], seed: int) -> list[list[int]]:
    """A document cut into sequences of varied lengths, as --split-sentences would."""
    out, pos, k = [], 0, seed
    while pos < len(doc):
        k = (k * 1103515245 + 12345) % (1 << 31)
        n = 1 + k % 97
        out.append(doc[pos:pos + n])
        pos += n
    return out


# ---- Megatron's own reader and writer ------------------------------------------------------------

MEGATRON_SCRIPT = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
import logging; logging.disable(logging.CRITICAL)
import numpy as np, torch
import megatron.core
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
job = json.load(open(sys.argv[1]))
result = {"version": megatron.core.__version__, "read": {}}
for prefix, npy in job["read"]:
    ds = IndexedDataset(prefix)
    seqs = [ds[i] for i in range(len(ds))]
    sliced = ds[0:len(ds)]
    assert all(np.array_equal(a, b) for a, b in zip(seqs, sliced))
    np.save(npy, np.concatenate(seqs).astype(np.int64))
    result["read"][npy] = {"lengths": [len(s) for s in seqs], "dtype": ds.index.dtype.__name__,
                              "document_indices": ds.document_indices.tolist()}
for w in job["write"]:
    tokens = np.load(w["tokens"])
    dtype = DType.optimal_dtype(w["vocab_size"]) if w["dtype"] == "optimal" else np.int32
    builder = IndexedDatasetBuilder(w["prefix"] + ".bin", dtype=dtype)
    pos = 0
    if w["empty_first"]:
        builder.end_document()
    for seq_lengths in w["documents"]:
        n = sum(seq_lengths)
        doc = torch.from_numpy(tokens[pos:pos + n])
        pos += n
        if w["mode"] == "items":
            at = 0
            for m in seq_lengths:
                builder.add_item(doc[at:at + m])
                at += m
            builder.end_document()
        else:
            builder.add_document(doc, seq_lengths)
    builder.finalize(w["prefix"] + ".idx")
json.dump(result, open(sys.argv[2], "w"))
'''


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, real_texts, bpe_tokenizer):
    """A store of real text (BPE, several shards) and its documents."""
    root = tmp_path_factory.mktemp("prepared")
    write_jsonl(root / "c.jsonl", real_texts[:120])
    prepare([str(root / "c.jsonl")], out=root / "store", tokenizer=bpe_tokenizer, workers=1,
            shard_tokens=60_000, progress=False)
    return root / "store", docs_of(root / "store")


@pytest.fixture(scope="module")
def megatron(prepared, tmp_path_factory, bpe_tokenizer):
    """Megatron (in a subprocess: it imports torch) reads the prepared shards and writes the same
    documents as datasets of its own: several sequences per document, and int32 tokens."""
    # megatron-core is a dev dependency: a missing install must fail here, never skip
    assert HAS_MEGATRON, "megatron-core is not installed (pip install -c constraints.txt megatron-core)"
    store, docs = prepared
    root = tmp_path_factory.mktemp("megatron")
    with TokenStore(store) as s:
        shards = [str(store / f"shard-{k:05d}") for k in range(s.num_shards)]
        per_shard = np.split(np.arange(len(s)), s.shard_doc_starts[1:-1])
        vocab = s.tokenizer["vocab_size"]
    job = {"read": [[p, str(root / f"read-{k}.npy")] for k, p in enumerate(shards)], "write": []}
    for k, doc_ids in enumerate(per_shard):
        tokens = np.concatenate([np.asarray(docs[d], np.int64) for d in doc_ids])
        np.save(root / f"tokens-{k}.npy", tokens)
        job["write"].append({"prefix": str(root / f"items-{k}"), "tokens": str(root / f"tokens-{k}.npy"),
                             "dtype": "optimal", "vocab_size": vocab, "mode": "items",
                             "empty_first": k == 0,
                             "documents": [[len(x) for x in split(docs[d], d)] for d in doc_ids]})
    np.save(root / "all.npy", np.concatenate([np.asarray(d, np.int64) for d in docs]))
    job["write"].append({"prefix": str(root / "int32"), "tokens": str(root / "all.npy"),
                         "dtype": "int32", "vocab_size": vocab, "mode": "document",
                         "empty_first": False, "documents": [[len(d)] for d in docs]})
    (root / "job.json").write_text(json.dumps(job))
    (root / "run.py").write_text(MEGATRON_SCRIPT)
    run = subprocess.run([sys.executable, str(root / "run.py"), str(root / "job.json"),
                          str(root / "result.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((root / "result.json").read_text())
    print(f"megatron-core {result['version']}")
    return root, len(per_shard), result


def test_megatron_reads_tokenmill_shards(prepared, megatron):
    store, docs = prepared
    _, _, result = megatron
    assert len(result["read"]) >= 3  # several shards
    got, lengths = [], []
    for npy, info in result["read"].items():  # in shard order
        assert info["dtype"] == "uint16"
        assert info["document_indices"] == list(range(len(info["lengths"]) + 1))
        flat = np.load(npy)
        lengths += info["lengths"]
        got.append(flat)
    flat = np.concatenate(got).tolist()
    assert lengths == [len(d) for d in docs]
    assert flat == [t for d in docs for t in d]


def test_megatron_written_datasets_import_exactly(prepared, megatron, tmp_path, bpe_tokenizer):
    store, docs = prepared
    root, n_shards, _ = megatron
    items = import_megatron([root / f"items-{k}" for k in range(n_shards)], out=tmp_path / "items",
                            tokenizer=bpe_tokenizer, progress=False)
    assert verify_store(tmp_path / "items") == []
    assert docs_of(tmp_path / "items") == docs  # sequences merged back into their documents
    # the same bytes as prepare wrote: .bin linked as they are, .idx rewritten one sequence per doc
    # (no .src: a Megatron dataset does not say where its documents came from)
    ref = store_bytes(store)
    assert {k: v for k, v in store_bytes(tmp_path / "items").items() if k != "manifest.json"} == \
        {k: v for k, v in ref.items() if k != "manifest.json" and not k.endswith(".src")}
    ref_manifest = json.loads(ref["manifest.json"])
    assert items["fingerprint"] == ref_manifest["fingerprint"]
    assert items["tokenizer"] == ref_manifest["tokenizer"]
    assert items["skipped"]["by_reason"] == {"empty_document": 1}  # Megatron's empty document
    with Loader(store, seq_len=256, batch_size=4, num_workers=0) as a, \
            Loader(tmp_path / "items", seq_len=256, batch_size=4, num_workers=0) as b:
        for k in range(5):
            want, got = a.batch_at(4 * k), b.batch_at(4 * k)
            assert all(np.array_equal(want[key], got[key]) for key in want)
    wide = import_megatron(root / "int32", out=tmp_path / "int32", tokenizer=bpe_tokenizer,
                           progress=False)
    assert wide["dtype"] == "int32" and docs_of(tmp_path / "int32") == docs
    assert verify_store(tmp_path / "int32") == []


# ---- the byte layout (always) ------------------------------------------------------------------

def test_store_shards_round_trip_through_import(prepared, tmp_path, bpe_tokenizer):
    """A prepared store's shards imported as Megatron prefixes give the very same store."""
    store, docs = prepared
    n = len(list(store.glob("shard-*.bin")))
    m = import_megatron([f"{store}/shard-{k:05d}.bin" for k in range(n)], out=tmp_path / "s",
                        tokenizer=bpe_tokenizer, progress=False)
    ref = json.loads((store / "manifest.json").read_text())
    assert m["fingerprint"] == ref["fingerprint"] and m["shards"] == [
        {k: v for k, v in s.items() if not k.startswith("src_")} for s in ref["shards"]]
    assert m["settings"]["links"] == ["hard"] * n
    assert (tmp_path / "s" / "shard-00000.bin").stat().st_ino == (store / "shard-00000.bin").stat().st_ino


def test_several_sequences_per_document_are_merged(tmp_path):
    docs = [[1, 2, 3, 256], [], [4, 256], [5, 6, 7, 8, 9, 256]]  # one empty document
    seqs = [[1, 2], [3, 256], [4, 256], [5], [6, 7, 8], [9, 256]]
    a = write_megatron(tmp_path / "a", seqs, [0, 2, 2, 3, 6])
    b = write_megatron(tmp_path / "b", [[7, 256]], [0, 1])
    m = import_megatron([a, b], out=tmp_path / "s", tokenizer="bytes", progress=False)
    assert docs_of(tmp_path / "s") == [d for d in docs if d] + [[7, 256]]
    assert verify_store(tmp_path / "s") == []
    assert m["skipped"] == {"total": 1, "by_reason": {"empty_document": 1}, "examples": [
        {"path": f"{a}.idx", "where": "document 1", "reason": "empty_document", "detail": "0 tokens"}]}
    assert m["settings"]["prefixes"] == [a, b] and m["settings"]["tokenizer"] == "bytes"
    assert m["tokenizer"]["vocab_size"] == 258


@pytest.mark.parametrize("link", ["hard", "symlink", "copy"])
def test_link_modes(tmp_path, link):
    p = write_megatron(tmp_path / "a", [[1, 2, 256], [3, 256]], [0, 1, 2])
    m = import_megatron(p, out=tmp_path / "s", tokenizer="bytes", link=link, progress=False)
    shard, src = tmp_path / "s" / "shard-00000.bin", Path(f"{p}.bin")
    assert m["settings"]["links"] == [link]
    assert shard.is_symlink() == (link == "symlink")
    assert (shard.stat().st_ino == src.stat().st_ino) == (link != "copy")
    assert shard.read_bytes() == src.read_bytes() and verify_store(tmp_path / "s") == []
    assert not [f for f in os.listdir(tmp_path / "s") if f.startswith(".")]


def test_hard_link_across_filesystems_falls_back_to_symlink(tmp_path, monkeypatch):
    p = write_megatron(tmp_path / "a", [[1, 256]], [0, 1])

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(interchange.os, "link", cross_device)
    m = import_megatron(p, out=tmp_path / "s", tokenizer="bytes", progress=False)
    assert m["settings"]["links"] == ["symlink"] and (tmp_path / "s" / "shard-00000.bin").is_symlink()
    assert docs_of(tmp_path / "s") == [[1, 256]]


def test_token_outside_the_vocabulary_names_shard_token_and_document(tmp_path):
    p = write_megatron(tmp_path / "a", [[1, 256], [2], [3, 999, 256]], [0, 1, 3])
    with pytest.raises(InputError, match=r"a\.bin: token 4 \(document 1\) is 999, outside \[0, 258\)"):
        import_megatron(p, out=tmp_path / "s", tokenizer="bytes", progress=False)
    assert not (tmp_path / "s").exists()  # nothing left behind
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="is 999"):
        import_megatron(p, out=tmp_path / "empty", tokenizer="bytes", link="copy", progress=False)
    assert os.listdir(tmp_path / "empty") == []  # an empty --out stays as it was
    neg = write_megatron(tmp_path / "n", [[1, -4, 256]], [0, 1], dtype=np.int32)
    with pytest.raises(InputError, match=r"n\.bin: token 1 \(document 0\) is -4"):
        import_megatron(neg, out=tmp_path / "s", tokenizer="bytes", progress=False)


def test_large_shard_is_scanned_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(interchange, "_CHUNK", 64)
    seq = (np.arange(1000) % 256).tolist()
    p = write_megatron(tmp_path / "a", [seq, seq[:37] + [300]], [0, 1, 2])
    with pytest.raises(InputError, match=r"token 1,037 \(document 1\) is 300"):
        import_megatron(p, out=tmp_path / "s", tokenizer="bytes", link="copy", progress=False)
    p = write_megatron(tmp_path / "b", [seq, seq[:37]], [0, 1, 2])
    import_megatron(p, out=tmp_path / "s", tokenizer="bytes", link="copy", progress=False)
    assert docs_of(tmp_path / "s") == [seq, seq[:37]] and verify_store(tmp_path / "s") == []


def test_refusals(tmp_path, bpe_tokenizer):
    ok = write_megatron(tmp_path / "ok", [[1, 256]], [0, 1])
    out = tmp_path / "s"

    def refused(prefixes, match, **kw):
        with pytest.raises((InputError, ConfigError), match=match):
            import_megatron(prefixes, out=out, tokenizer=kw.pop("tokenizer", "bytes"), progress=False, **kw)
        assert not out.exists()

    refused(tmp_path / "missing", r"missing\.idx: not found")
    refused([ok, write_megatron(tmp_path / "w", [[1, 256]], [0, 1], dtype=np.int32)],
            r"w\.idx: token dtype int32, but .*ok\.idx has uint16")
    refused(write_megatron(tmp_path / "i64", [[1, 256]], [0, 1], dtype=np.int64),
            r"token dtype int64; a tokenmill store holds uint16 or int32")
    refused(write_megatron(tmp_path / "mm", [[1, 256]], [0, 1], modes=True), "multimodal")
    refused(write_megatron(tmp_path / "tail", [[1], [256]], [0, 1]),
            r"document index must rise from 0 to the 2 sequences")
    big = write_megatron(tmp_path / "big", [[1, 256]], [0, 1])
    with open(f"{big}.bin", "ab") as f:
        f.write(b"\0\0")
    refused(big, r"big\.bin: 6 bytes, but its index holds 2 uint16 tokens")
    gap = write_megatron(tmp_path / "gap", [[1, 2], [256]], [0, 2])
    raw = bytearray(Path(f"{gap}.idx").read_bytes())
    raw[34 + 8 + 8:34 + 8 + 16] = struct.pack("<q", 2)  # second sequence starts at byte 2, not 4
    Path(f"{gap}.idx").write_bytes(bytes(raw))
    refused(gap, r"gap\.idx: sequence 1 starts at byte 2 of the \.bin, not 4: .*not back to back")
    refused(ok, "link must be one of", link="move")
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty directory"):
        import_megatron(ok, out=out, tokenizer="bytes", progress=False)
    assert (out / "x").exists()


def test_dtype_must_hold_the_vocabulary(tmp_path):
    p = write_megatron(tmp_path / "a", [[1, 2]], [0, 1])
    big = tmp_path / "big.json"  # a word-level tokenizer.json of 70,001 ids: more than uint16 holds
    big.write_text(json.dumps({"version": "1.0", "added_tokens": [
        {"id": 70000, "content": "<|endoftext|>", "special": True, "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False}],
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(70000)}, "unk_token": "t0"}}))
    with pytest.warns(UserWarning, match="encoding with tokenizers"), \
            pytest.raises(InputError, match=r"uint16 tokens cannot hold the ids of .*vocab_size 70,001"):
        import_megatron(p, out=tmp_path / "s", tokenizer=str(big), progress=False)


# ---- export ------------------------------------------------------------------------------------

def test_export_nanogpt_is_the_token_stream(prepared, tmp_path):
    store, docs = prepared
    info = export(store, out=tmp_path / "out" / "train.bin", format="nanogpt", progress=False)
    data = np.memmap(tmp_path / "out" / "train.bin", dtype=np.uint16, mode="r")  # nanoGPT's reader
    assert data.tolist() == [t for d in docs for t in d]
    eos = TokenStore(store).tokenizer["eos_id"]
    assert int((data == eos).sum()) >= len(docs) and all(d[-1] == eos for d in docs)
    meta = tmp_path / "out" / "meta.pkl"
    assert info == {"format": "nanogpt", "out": str(tmp_path / "out" / "train.bin"),
                    "documents": len(docs), "tokens": len(data), "bytes": 2 * len(data),
                    "files": [str(tmp_path / "out" / "train.bin"), str(meta)]}
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.pkl", "train.bin"]
    # nanoGPT's train.py: meta = pickle.load(f); meta_vocab_size = meta['vocab_size']
    vocab = TokenStore(store).tokenizer["vocab_size"]
    assert pickle.loads(meta.read_bytes()) == {"vocab_size": vocab} and data.max() < vocab


def test_cli_export_of_a_split_writes_train_val_and_meta(tmp_path):
    """One `tokenmill export` of a --val-fraction folder gives nanoGPT's whole data_dir: train.bin
    and val.bin (each side's tokens exactly) and meta.pkl (the vocabulary, not nanoGPT's 50,304)."""
    texts = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(200)]
    write_jsonl(tmp_path / "c.jsonl", texts)
    tm = [sys.executable, "-m", "tokenmill"]
    r = subprocess.run(tm + ["prepare", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "s"),
                             "--tokenizer", "bytes", "--val-fraction", "0.2", "--workers", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = tmp_path / "data" / "mine"
    r = subprocess.run(tm + ["export", str(tmp_path / "s"), "--format", "nanogpt", "--out", str(data)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"wrote {data / 'train.bin'}, {data / 'val.bin'}, {data / 'meta.pkl'}: 200 documents" in r.stderr
    assert sorted(os.listdir(data)) == ["meta.pkl", "train.bin", "val.bin"]
    for side in ("train", "val"):
        want = [t for d in docs_of(tmp_path / "s" / side) for t in d]
        assert 0 < len(want) and np.memmap(data / f"{side}.bin", dtype=np.uint16, mode="r").tolist() == want
    assert pickle.loads((data / "meta.pkl").read_bytes()) == {"vocab_size": 258}
    r = subprocess.run(tm + ["export", str(tmp_path / "s"), "--format", "nanogpt", "--out",
                             str(tmp_path / "train.bin")], capture_output=True, text=True)
    assert r.returncode == 2 and "--out names that folder" in r.stderr and not (tmp_path / "train.bin").exists()


def _tm(*args) -> subprocess.CompletedProcess:
    """`tokenmill ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("vocab", ["abc", "258", None, True, 258.0, 0])
def test_a_manifest_whose_vocab_size_is_no_positive_int_is_refused_by_every_reader(tmp_path, vocab):
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import manifest_checksum, store_fingerprint
    write_jsonl(tmp_path / "c.jsonl", [f"document {i}" for i in range(20)])
    assert _tm("prepare", tmp_path / "c.jsonl", "--out", tmp_path / "s", "--tokenizer", "bytes",
               "--workers", "1").returncode == 0
    path = tmp_path / "s" / "manifest.json"  # edited, its checksum made to hold again
    m = json.loads(path.read_text())
    m["tokenizer"]["vocab_size"] = vocab
    m["fingerprint"] = store_fingerprint(m)
    m["manifest_xxh3"] = manifest_checksum(m)
    atomic_write_json(path, m)
    want = f"{path}: the tokenizer's vocab_size {vocab!r} is not a positive integer"
    for cmd in (["export", tmp_path / "s", "--format", "nanogpt", "--out", tmp_path / "o" / "train.bin"],
                ["inspect", tmp_path / "s"]):
        r = _tm(*cmd)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
    r = _tm("verify", tmp_path / "s")
    assert r.returncode == 1 and want in r.stdout + r.stderr
    with pytest.raises(StoreError, match="is not a positive integer"):
        Loader(tmp_path / "s", seq_len=4, batch_size=2)


@pytest.mark.parametrize("flag,setting", [("--no-eos", "add_eos"), ("--bos", "add_bos")])
def test_export_of_a_split_whose_sides_end_documents_differently_is_refused(tmp_path, flag, setting):
    write_jsonl(tmp_path / "c.jsonl", [f"document {i}" for i in range(100)])
    for out, more in (("a", ()), ("b", (flag,))):
        r = _tm("prepare", tmp_path / "c.jsonl", "--out", tmp_path / out, "--tokenizer", "bytes",
                "--val-fraction", "0.2", "--workers", "1", *more)
        assert r.returncode == 0, r.stderr
    shutil.rmtree(tmp_path / "a" / "val")
    shutil.copytree(tmp_path / "b" / "val", tmp_path / "a" / "val")  # val/ of the other run
    r = _tm("export", tmp_path / "a", "--format", "nanogpt", "--out", tmp_path / "data")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"its train/ and val/ were prepared with other '{setting}' settings" in r.stderr
    assert not (tmp_path / "data").exists()


def test_export_nanogpt_int32(tmp_path, monkeypatch):
    p = write_megatron(tmp_path / "a", [[1, 2, 256], [257, 3, 256]], [0, 1, 2], dtype=np.int32)
    import_megatron(p, out=tmp_path / "s", tokenizer="bytes", progress=False)
    monkeypatch.setattr(interchange, "_CHUNK", 4)  # 2 tokens per chunk
    export(tmp_path / "s", out=tmp_path / "t.bin", format="nanogpt", progress=False)
    assert np.fromfile(tmp_path / "t.bin", "<u2").tolist() == [1, 2, 256, 257, 3, 256]
    write_positional_store(tmp_path / "wide", [5, 7])  # int32, vocab_size 2^31
    with pytest.raises(StoreError, match=r"int32 tokens \(vocab_size 2147483648\); nanoGPT's reader "
                                         r"takes uint16 ids"):
        export(tmp_path / "wide", out=tmp_path / "w.bin", format="nanogpt", progress=False)
    assert not (tmp_path / "w.bin").exists()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".")] == []


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_text_store_text_round_trip_is_exact(tmp_path, real_texts, bpe_tokenizer, tokenizer):
    spec = bpe_tokenizer if tokenizer == "bpe" else "bytes"
    texts = real_texts[:80] + ["<|endoftext|> inside, and at the end <|endoftext|>", "é✓ 🚀\r\n\ttabs"]
    write_jsonl(tmp_path / "in.jsonl", texts)
    prepare([str(tmp_path / "in.jsonl")], out=tmp_path / "s", tokenizer=spec, workers=1,
            shard_tokens=50_000, progress=False)
    export(tmp_path / "s", out=tmp_path / "back.jsonl", format="jsonl", progress=False)
    lines = (tmp_path / "back.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [{"text": t} for t in texts]
    # and back again: the same store, byte for byte
    prepare([str(tmp_path / "back.jsonl")], out=tmp_path / "again", tokenizer=spec, workers=1,
            shard_tokens=50_000, progress=False)
    assert {k: v for k, v in store_bytes(tmp_path / "again").items() if k != "manifest.json"} == \
        {k: v for k, v in store_bytes(tmp_path / "s").items() if k != "manifest.json"}


def test_export_jsonl_with_bos_and_imported_store(tmp_path, bpe_tokenizer):
    write_jsonl(tmp_path / "in.jsonl", ["first", "second one"])
    prepare([str(tmp_path / "in.jsonl")], out=tmp_path / "s", add_bos=True, workers=1, progress=False)
    export(tmp_path / "s", out=tmp_path / "a.jsonl", format="jsonl", progress=False)
    assert (tmp_path / "a.jsonl").read_text() == '{"text": "first"}\n{"text": "second one"}\n'
    # an imported store: the tokenizer spec given at import; one trailing EOS stripped if present
    p = write_megatron(tmp_path / "m", [list(b"no eos"), list(b"eos") + [256, 256]], [0, 1, 2])
    import_megatron(p, out=tmp_path / "i", tokenizer="bytes", progress=False)
    export(tmp_path / "i", out=tmp_path / "i.jsonl", format="jsonl", progress=False)
    assert (tmp_path / "i.jsonl").read_text() == '{"text": "no eos"}\n{"text": "eos<|endoftext|>"}\n'


def test_export_jsonl_checks_the_tokenizer(tmp_path, real_texts, bpe_tokenizer):
    from tokenmill.tokenizer import train_bpe
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_bytes(Path(bpe_tokenizer).read_bytes())
    write_jsonl(tmp_path / "in.jsonl", real_texts[:3])
    prepare([str(tmp_path / "in.jsonl")], out=tmp_path / "s", tokenizer=str(tok), workers=1,
            progress=False)
    other = train_bpe(real_texts[:20], 600, out_path=tmp_path / "other.json")
    with pytest.raises(TokenizerError, match=r"other\.json: not the tokenizer .* \(vocab_size 600 ≠ 2000, "
                                             r"file_xxh3 '[0-9a-f]+' ≠ '[0-9a-f]+'\)"):
        export(tmp_path / "s", out=tmp_path / "x.jsonl", format="jsonl", tokenizer=other, progress=False)
    tok.rename(tmp_path / "moved.json")
    with pytest.raises(TokenizerError, match=r"not found.*the spec recorded in the manifest.*--tokenizer"):
        export(tmp_path / "s", out=tmp_path / "x.jsonl", format="jsonl", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "moved.json", "other.json", "s", "tok"]
    export(tmp_path / "s", out=tmp_path / "x.jsonl", format="jsonl", tokenizer=tmp_path / "moved.json",
           progress=False)
    assert [json.loads(x)["text"] for x in open(tmp_path / "x.jsonl")] == real_texts[:3]
    with pytest.raises(ConfigError, match="format must be one of"):
        export(tmp_path / "s", out=tmp_path / "x.csv", format="csv")


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    p = write_megatron(tmp_path / "a", [list(b"abc"), [256]], [0, 2])
    import_megatron(p, out=tmp_path / "s", tokenizer="bytes")
    export(tmp_path / "s", out=tmp_path / "t.bin", format="nanogpt")
    assert "import: 100%" in term.getvalue() and "export: 100%" in term.getvalue()
    term.truncate(0)
    export(tmp_path / "s", out=tmp_path / "t.jsonl", format="jsonl", progress=False)
    assert term.getvalue() == ""


def test_cli_import_then_export(tmp_path, capsys):
    p = write_megatron(tmp_path / "a", [list(b"hello"), [256], list(b"world"), [256]], [0, 2, 4])
    assert main(["import-megatron", p, "--out", str(tmp_path / "s"), "--tokenizer", "bytes"]) == 0
    err = capsys.readouterr().err
    assert "done: 2 documents, 12 tokens in 1 shard(s); skipped 0; .bin files: hard" in err
    assert main(["verify", str(tmp_path / "s")]) == 0
    assert main(["export", str(tmp_path / "s"), "--format", "jsonl", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert (tmp_path / "o.jsonl").read_text() == '{"text": "hello"}\n{"text": "world"}\n'
    assert main(["export", str(tmp_path / "s"), "--format", "nanogpt", "--out", str(tmp_path / "t.bin"),
                 "--quiet"]) == 0
    assert np.fromfile(tmp_path / "t.bin", "<u2").tolist() == list(b"hello") + [256] + list(b"world") + [256]
    capsys.readouterr()
    assert main(["import-megatron", str(tmp_path / "nope"), "--out", str(tmp_path / "x"),
                 "--tokenizer", "bytes"]) == 2
    assert "tokenmill import-megatron: error: " in capsys.readouterr().err


# ---- export checks what it reads (issue 12.10) and says why it cannot write (12.16) --------------

EXPORT_SCRIPT = '''
import sys
from tokenmill.interchange import export
print(export(sys.argv[1], out=sys.argv[2], format=sys.argv[3], progress=False))
'''


@pytest.mark.parametrize("ext", [".bin", ".idx"])
@pytest.mark.parametrize("fmt", ["nanogpt", "jsonl"])
def test_export_of_a_shard_changed_after_prepare_fails_naming_it(prepared, tmp_path, ext, fmt):
    store = tmp_path / "store"
    store.mkdir()
    for f in prepared[0].iterdir():
        (store / f.name).write_bytes(f.read_bytes())
    victim = store / f"shard-00001{ext}"
    data = victim.read_bytes()
    if ext == ".bin":  # the same tokens, two of them swapped: same size, other bytes
        data = data[2:4] + data[:2] + data[4:]
    else:  # the last two document boundaries swapped: same size, the header intact
        data = data[:-16] + data[-8:] + data[-16:-8]
    victim.write_bytes(data)
    script = tmp_path / "export_it.py"
    script.write_text(EXPORT_SCRIPT)
    out = tmp_path / "out" / ("train.bin" if fmt == "nanogpt" else "docs.jsonl")
    r = subprocess.run([sys.executable, str(script), str(store), str(out), fmt],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "StoreError: " in r.stderr
    assert f"{victim}: checksum mismatch" in r.stderr and "nothing was exported" in r.stderr
    assert not out.exists() and os.listdir(out.parent) == []  # no partial file, no temporary
    r = subprocess.run([sys.executable, "-m", "tokenmill", "export", str(store), "--format", fmt,
                        "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("tokenmill export: error: ") and str(victim) in r.stderr


def test_export_to_a_folder_it_cannot_make_is_a_clear_error(prepared, tmp_path):
    (tmp_path / "afile").write_text("mine\n")
    with pytest.raises(ConfigError, match=r"afile/x\.bin: cannot write .*a part of its folder is "
                                          r"a file, not a folder"):
        export(prepared[0], out=tmp_path / "afile" / "x.bin", format="nanogpt", progress=False)
    assert (tmp_path / "afile").read_text() == "mine\n"
    info = export(prepared[0], out=tmp_path / "new" / "dir" / "x.bin", format="nanogpt",
                  progress=False)  # a missing folder is made
    assert info["bytes"] == 2 * info["tokens"] and sorted(os.listdir(tmp_path / "new" / "dir")) == ["meta.pkl", "x.bin"]


def test_export_of_a_split_folder_whose_sides_do_not_belong_together_is_refused(tmp_path, bpe_tokenizer):
    """A folder holding train/ and val/ that are not the two sides of one split: made with two
    tokenizers (val.bin's ids would mean other tokens than meta.pkl's vocabulary), or with two
    fractions (documents in both train.bin and val.bin): one line naming the folder, no file."""
    texts = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(200)]
    write_jsonl(tmp_path / "c.jsonl", texts)
    for name, train, val in (("tok", dict(tokenizer=bpe_tokenizer), dict(tokenizer="bytes")),
                             ("frac", dict(holdout=("train", 0.1)), dict(holdout=("val", 0.3)))):
        for side, kw in (("train", train), ("val", val)):
            kw = {"tokenizer": "bytes", "holdout": (side, 0.2), **kw}
            prepare(str(tmp_path / "c.jsonl"), out=tmp_path / name / side, workers=1,
                    progress=False, **kw)
        r = subprocess.run([sys.executable, "-m", "tokenmill", "export", str(tmp_path / name),
                            "--format", "nanogpt", "--out", str(tmp_path / f"{name}-out")],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and str(tmp_path / name) in r.stderr
        assert ("different tokenizers" if name == "tok" else "not the two sides of one split") \
            in r.stderr
        assert not (tmp_path / f"{name}-out").exists()


# ---- a manifest that lies about the vocabulary (issue 22.5, red team round 2) -------------------

def _lie_about_vocab(store: Path, vocab: int) -> None:
    """Edit the manifest's tokenizer vocab_size as a tool would: fingerprint and checksum redone."""
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import manifest_checksum, store_fingerprint
    m = json.loads((store / "manifest.json").read_text())
    m["tokenizer"]["vocab_size"] = vocab
    m["fingerprint"] = store_fingerprint(m)
    m["manifest_xxh3"] = manifest_checksum(m)
    atomic_write_json(store / "manifest.json", m)


def _tokenmill(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_manifest_lying_about_vocab_size_fails_verify_and_export_naming_shard_and_id(tmp_path, dtype):
    store = tmp_path / "store"
    if dtype == "uint16":  # prepared: bytes of the text, EOS 256, vocab 258
        (tmp_path / "in.jsonl").write_text('{"text": "abc"}\n{"text": "hello world"}\n')
        assert _tokenmill("prepare", "in.jsonl", "--out", store, "--tokenizer", "bytes",
                          cwd=tmp_path).returncode == 0
    else:  # a Megatron dataset of int32 ids imported as it is
        p = write_megatron(tmp_path / "m", [list(b"abc") + [256], list(b"hello world") + [256]],
                           [0, 1, 2], dtype=np.int32)
        import_megatron(p, out=store, tokenizer="bytes", progress=False)
    assert TokenStore(store, verify="off").dtype == np.dtype(dtype)
    assert _tokenmill("verify", store, cwd=tmp_path).returncode == 0
    _lie_about_vocab(store, 200)  # the text's bytes fit, EOS (256, token 3) does not
    r = _tokenmill("verify", store, cwd=tmp_path)
    assert r.returncode == 1, r.stdout
    assert r.stdout.splitlines()[0] == (f"BAD  {store}/shard-00000.bin: token 3 is id 256, not "
                                        "below the manifest's tokenizer vocab_size 200 (an edited "
                                        "manifest, or another tokenizer's ids)"), r.stdout
    r = _tokenmill("export", store, "--format", "nanogpt", "--out", tmp_path / "out" / "train.bin",
                   cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"tokenmill export: error: {store}/shard-00000.bin: token 3 is id "
                               "256, not below the manifest's vocab_size 200"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # no meta.pkl
    _lie_about_vocab(store, 258)  # the truth again: both pass
    assert _tokenmill("verify", store, cwd=tmp_path).returncode == 0
    r = _tokenmill("export", store, "--format", "nanogpt", "--out", tmp_path / "out" / "train.bin",
                   cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert pickle.loads((tmp_path / "out" / "meta.pkl").read_bytes()) == {"vocab_size": 258}
