"""The store format: writer, memory-mapped reader, an independent reader, verify; shard names,
descriptors of a 100,000-shard store, background checksums."""

import json
import mmap
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

import tokenmill
from tokenmill.base.errors import ConfigError, StoreError
from tokenmill.base.io import atomic_write_json
from tokenmill.store import (ShardInfo, ShardWriter, TokenStore, build_manifest, idx_bytes,
                             manifest_checksum, read_idx, shard_name, verify_store)


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
    docs = [np.frombuffer(data, dtype, int(ln), int(p)).tolist() for ln, p in zip(lengths, pointers)]
    return docs, doc_idx.tolist()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_shards_read_back_by_independent_reader(tmp_path, dtype):
    lengths = [7, 1, 30, 45, 2, 60, 3, 9, 11]
    docs = positional_docs(lengths)
    manifest = write_store(tmp_path, docs, dtype=dtype, shard_tokens=50)
    got = []
    for s in manifest["shards"]:
        d, idx = independent_read(tmp_path / s["name"])
        got += d
        assert idx == list(range(len(d) + 1))
    assert got == docs
    # a shard closes at the first document boundary at or past 50 tokens
    assert [s["num_tokens"] for s in manifest["shards"]] == [83, 62, 23]


def memory_mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a memory-mapped file (somewhere down its ``base`` chain)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return False


def test_token_store_api(tmp_path):
    lengths = [5, 17, 1, 40, 33, 8, 21]
    docs = positional_docs(lengths)
    write_store(tmp_path, docs, shard_tokens=30)
    with TokenStore(tmp_path) as store:
        assert len(store) == len(docs)
        assert store.num_tokens == sum(lengths)
        assert store.num_shards > 2
        assert store.doc_lengths.tolist() == lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        assert store.doc_spans(np.arange(len(lengths)))[0].tolist() == starts.tolist()
        for i, doc in enumerate(docs):
            assert store[i].tolist() == doc
            assert memory_mapped(store[i])
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


# ---- shard names are plain file names inside the store (issue 12.9) -----------------------------

@pytest.mark.parametrize("name", ["../shard-00001", "/tmp/shard-00001", "sub/shard-00001",
                                  "shard-00001/../../x", "shard-1", "shard-00000", ".shard-00001",
                                  "shard-00001.bin", 7])
def test_a_manifest_naming_a_shard_outside_the_store_is_refused(tmp_path, name):
    store = tmp_path / "store"
    write_store(store, positional_docs([30, 30, 30]), shard_tokens=40)
    outside = tmp_path / "shard-00001"  # what "../shard-00001" would read: same size, other bytes
    for ext in (".bin", ".idx"):
        (outside.parent / f"{outside.name}{ext}").write_bytes(
            bytes(len((store / f"shard-00001{ext}").read_bytes())))
    m = json.loads((store / "manifest.json").read_text())
    m["shards"][1]["name"] = name  # "shard-00000" twice is refused too
    m["manifest_xxh3"] = manifest_checksum(m)  # edited with care: only the name check stands
    atomic_write_json(store / "manifest.json", m)
    with pytest.raises(StoreError, match=r"shard 1 is named .*plain file names inside the store"):
        TokenStore(store)
    (problem,) = verify_store(store)
    assert "shard 1 is named" in problem and "manifest.json" in problem


# ---- a 100,000-shard store: fast to open, few descriptors (issue 12.5) --------------------------

def write_many_shard_store(path: Path, shards: int) -> Path:
    """A store of ``shards`` shards of one 8-token document each, token i of a shard being i:
    every .bin (and .idx) is a hard link to one of a few files (a link count is bounded)."""
    path.mkdir(parents=True)
    data = np.arange(8, dtype=np.uint16).tobytes()
    idx = idx_bytes(np.array([8]), np.uint16)
    info = dict(num_documents=1, num_tokens=8, bin_bytes=len(data), idx_bytes=len(idx),
                bin_xxh3=xxhash.xxh3_64_hexdigest(data), idx_xxh3=xxhash.xxh3_64_hexdigest(idx))
    for i in range(shards):
        if i % 50_000 == 0:
            src = path / f".src-{i}"
            (src.with_suffix(".bin")).write_bytes(data)
            (src.with_suffix(".idx")).write_bytes(idx)
        for ext in (".bin", ".idx"):
            os.link(src.with_suffix(ext), path / f"{shard_name(i)}{ext}")
    infos = [ShardInfo(name=shard_name(i), **info) for i in range(shards)]
    manifest = build_manifest(tokenizer={"kind": "test", "vocab_size": 8}, dtype=np.uint16,
                              shards=infos, settings={}, skipped={"total": 0})
    atomic_write_json(path / "manifest.json", manifest)
    return path


AUDITED = '''
import resource  # a descriptor limit of 128: the default max_open is then 32
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import json, os, random, sys, time

def fds():
    return len(os.listdir("/proc/self/fd"))

opened = []  # files of the store this process opens (an audit hook sees every open())
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(sys.argv[1]):
        opened.append(os.path.basename(args[0]))
sys.addaudithook(hook)
'''  # the start of both programs: descriptors counted, the store's files opened listed


READ_MANY_SHARDS = AUDITED + '''
from tokenmill.store import TokenStore
before = fds()
start = time.perf_counter()
store = TokenStore(sys.argv[1])
open_s, opened_at_open = time.perf_counter() - start, list(opened)
after_open, peak, rng, exact = fds(), 0, random.Random(0), True
start = time.perf_counter()
for k in range(3000):  # windows across 3 shards, all over the store
    s = rng.randrange(store.num_tokens - 20)
    exact &= store.tokens(s, s + 20).tolist() == [p % 8 for p in range(s, s + 20)]
    exact &= store[rng.randrange(len(store))].tolist() == list(range(8))
    peak = max(peak, fds())
read_s = time.perf_counter() - start
store.check(wait=True)
store.close()
print(json.dumps(dict(before=before, open_s=open_s, after_open=after_open, peak=peak,
                      after_close=fds(), read_s=read_s, exact=exact,
                      opened_at_open=opened_at_open)))
'''


LOAD_MANY_SHARDS = AUDITED + '''
import numpy as np
from tokenmill import Loader
before = fds()
start = time.perf_counter()
loader = Loader(sys.argv[1], seq_len=64, batch_size=8, num_workers=0, seed=0)
open_s, opened_at_open, peak, exact = time.perf_counter() - start, list(opened), 0, True
for _, batch in zip(range(200), loader):
    exact &= bool((np.diff(batch["inputs"], axis=1) % 8 == 1).all())  # token p is p % 8
    peak = max(peak, fds())
loader.close()
print(json.dumps(dict(before=before, open_s=open_s, peak=peak, after_close=fds(), exact=exact,
                      opened_at_open=opened_at_open)))
'''


def test_a_100000_shard_store_opens_fast_reads_with_few_descriptors_and_closes_clean(tmp_path):
    store = write_many_shard_store(tmp_path / "store", 100_000)
    for name, code in (("read_many_shards.py", READ_MANY_SHARDS),
                       ("load_many_shards.py", LOAD_MANY_SHARDS)):
        script = tmp_path / name
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script), str(store)], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["exact"]
        assert got.get("after_open", got["before"]) == got["before"]  # nothing held per shard
        # at most max_open maps (32, the least: the scripts allow 128 descriptors), one being hashed
        assert got["peak"] < 64, got
        assert got["after_close"] == got["before"], got
        # opening costs no work per shard beyond a stat: it opens the manifest and no shard
        # file (0.55 s measured on a 2-core VM, not asserted: a busy machine may be slower)
        assert got["opened_at_open"] == ["manifest.json"], got["opened_at_open"][:5]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_maps_are_bounded_and_reopened_on_demand(tmp_path):
    write_store(tmp_path, positional_docs([10] * 40), shard_tokens=10)  # 40 shards
    flat = [t for d in positional_docs([10] * 40) for t in d]
    before = open_descriptors()
    with TokenStore(tmp_path, max_open=4, verify="off") as store:
        for _ in range(2):  # round and round: every shard is dropped and mapped again
            for i in range(40):
                assert store[i].tolist() == flat[10 * i:10 * i + 10]
                assert open_descriptors() <= before + 4  # a .bin and an .idx of two shards
        kept = store.shard(3)
    assert open_descriptors() == before + 1  # the view handed out keeps its map
    assert kept.tolist() == flat[30:40]  # a view handed out stays valid after close
    del kept
    assert open_descriptors() == before
    with pytest.raises(StoreError, match="closed"):
        store.tokens(0, 5)
    with pytest.raises(ConfigError, match="max_open"):
        TokenStore(tmp_path, max_open=1)
    with pytest.raises(ConfigError, match="verify"):
        TokenStore(tmp_path, verify="sometimes")


# ---- token bytes changed after prepare fail the next read (issue 12.14) -------------------------

@pytest.fixture()
def changed_store(tmp_path):
    """A prepared store (several shards) whose shard-00001.bin then got other bytes, same size."""
    texts = [f"document {i} " + "lorem ipsum " * (i % 17 + 3) for i in range(400)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    store = tmp_path / "store"
    tokenmill.prepare(str(tmp_path / "c.jsonl"), out=store, workers=1, progress=False,
                      shard_tokens=5_000)
    assert len(json.loads((store / "manifest.json").read_text())["shards"]) >= 3
    original = (store / "shard-00001.bin").read_bytes()
    changed = original[2:] + original[:2]  # the same tokens, shifted: same size, other bytes
    (store / "shard-00001.bin").write_bytes(changed)
    return store, original


def test_a_changed_shard_fails_the_next_read_naming_it(changed_store):
    store, original = changed_store
    with TokenStore(store) as st:
        st.tokens(0, 10)  # shard 0 is intact
        st.check(wait=True)
        first = int(st.shard_token_starts[1])
        st.tokens(first, first + 10)  # the read that maps shard 1 starts its check
        with pytest.raises(StoreError, match=r"shard-00001\.bin: checksum mismatch .*changed"):
            st.check(wait=True)
        with pytest.raises(StoreError, match=r"shard-00001\.bin: checksum mismatch"):
            st.tokens(0, 10)  # every later read fails, whatever shard it touches
    with TokenStore(store) as again:  # checked once per process: known at once
        again.shard(1)
        with pytest.raises(StoreError, match=r"shard-00001\.bin"):
            again.check()
    with TokenStore(store, verify="off") as off:
        off.shard(1)
        off.check(wait=True)  # the option turns it off
    (store / "shard-00001.bin").write_bytes(original)  # a new file (mtime): checked again
    with TokenStore(store) as fixed:
        fixed.shard(1)
        fixed.check(wait=True)


CHANGED_STORE_SCRIPTS = {
    "TokenStore": '''
import sys
from tokenmill.store import TokenStore

with TokenStore(sys.argv[1]) as store:
    for _ in range(100):  # a training loop reading the store over and over
        for start in range(0, store.num_tokens - 64, 64):
            store.tokens(start, start + 64)
print("read every token without noticing")
''',
    "Loader": '''
import sys
from tokenmill import Loader

with Loader(sys.argv[1], seq_len=64, batch_size=8, seed=0) as loader:
    for step, batch in zip(range(20_000), loader):  # a training loop
        pass
print("read every token without noticing")
''',
}


@pytest.mark.parametrize("reader", list(CHANGED_STORE_SCRIPTS))
def test_a_script_reading_a_changed_store_fails_loudly(changed_store, tmp_path, reader):
    store, _ = changed_store
    script = tmp_path / "train.py"
    script.write_text(CHANGED_STORE_SCRIPTS[reader])
    r = subprocess.run([sys.executable, str(script), str(store)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "without noticing" not in r.stdout
    assert "StoreError: " in r.stderr and f"{store}/shard-00001.bin: checksum mismatch" in r.stderr


# ---- a store re-prepared underneath an open reader is refused at the next map -------------------

def prepare_texts(tmp_path: Path, texts: list[str], store: Path, **options) -> None:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenmill.prepare(str(tmp_path / "in.jsonl"), out=store, workers=1, progress=False,
                      shard_tokens=2_000, **options)


@pytest.mark.parametrize("first_read", ["tokens", "document", "shard"])
def test_a_store_re_prepared_after_open_fails_the_first_read_naming_the_shard(tmp_path,
                                                                            first_read):
    store = tmp_path / "store"
    old = [f"old document {i:04d} " + "abc " * (i % 13 + 5) for i in range(300)]
    new = [t.replace("old", "NEW").replace("abc", "xyz") for t in old]  # same bytes per document
    prepare_texts(tmp_path, old, store)
    sizes = {p.name: p.stat().st_size for p in store.glob("shard-*")}
    assert len(sizes) >= 6  # at least three shards
    reader = TokenStore(store)  # opened; nothing read yet, so nothing mapped
    prepare_texts(tmp_path, new, store, overwrite=True)
    # the same shard names and sizes: only the files' identity tells them apart
    assert {p.name: p.stat().st_size for p in store.glob("shard-*")} == sizes
    read = {"tokens": lambda: reader.tokens(0, 10), "document": lambda: reader[5],
            "shard": lambda: reader.shard(2)}[first_read]
    with pytest.raises(StoreError, match=r"/shard-0000\d\.(bin|idx): the store changed since it "
                                         r"was opened .*create a new Loader"):
        read()
    reader.close()
    with TokenStore(store) as fresh:  # opened again: reads the new tokens ("bytes" tokenizer)
        assert fresh.tokens(0, 3).tolist() == list(b"NEW")
        assert fresh.fingerprint != reader.fingerprint


# ---- a manifest that lies about its shards' counts (issue 22.5) ---------------------------------

LIES = {  # what a tool that edits manifest.json (and re-computes its checksum) may get wrong
    "3 tokens over": lambda m, s: _claim(m, s, tokens=s["num_tokens"] + 3),
    "3 tokens under": lambda m, s: _claim(m, s, tokens=s["num_tokens"] - 3),
    "10x the tokens": lambda m, s: _claim(m, s, tokens=s["num_tokens"] * 10),
    "a tenth of the tokens": lambda m, s: _claim(m, s, tokens=s["num_tokens"] // 10),
    "a document more": lambda m, s: _claim(m, s, docs=s["num_documents"] + 1),
    "3 tokens over, bytes to match": lambda m, s: _claim(m, s, tokens=s["num_tokens"] + 3,
                                                         bin_bytes=True),
    "3 tokens over in the totals alone": lambda m, s: m.update(num_tokens=m["num_tokens"] + 3),
}


def _claim(manifest: dict, shard: dict, *, tokens: int | None = None, docs: int | None = None,
           bin_bytes: bool = False) -> None:
    """Edit one shard's counts and the totals with them, as a careful editing tool would."""
    if tokens is not None:
        manifest["num_tokens"] += tokens - shard["num_tokens"]
        shard["num_tokens"] = tokens
        if bin_bytes:  # uint16 tokens (the "bytes" tokenizer's store): two bytes each
            shard["bin_bytes"] = 2 * tokens
    if docs is not None:
        manifest["num_documents"] += docs - shard["num_documents"]
        shard["num_documents"] = docs


LYING_LOADER = '''
import sys
from tokenmill import Loader

for layout in ("concat", "packed"):
    try:
        with Loader(sys.argv[1], seq_len=32, batch_size=4, layout=layout, seed=1) as loader:
            for step, batch in zip(range(2_000), loader):  # more than an epoch
                print(layout, "served batch", step, flush=True)
    except Exception as e:
        print(layout, "raised", f"{type(e).__name__}: {e}", flush=True)
'''


@pytest.fixture(scope="module")
def prepared_store(tmp_path_factory) -> Path:
    """A store made by tokenmill.prepare from a small .jsonl: one shard of ~48,000 tokens."""
    tmp = tmp_path_factory.mktemp("honest")
    texts = [f"document {i} " + "lorem ipsum dolor " * (i % 23 + 2) for i in range(200)]
    (tmp / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenmill.prepare(str(tmp / "in.jsonl"), out=tmp / "store", workers=1, progress=False)
    return tmp / "store"


@pytest.mark.parametrize("lie", list(LIES))
def test_a_loader_over_a_manifest_that_lies_about_counts_refuses_naming_the_shard(
        prepared_store, tmp_path, lie):
    store = tmp_path / "store"
    store.mkdir()
    for p in prepared_store.iterdir():
        (store / p.name).write_bytes(p.read_bytes())
    m = json.loads((store / "manifest.json").read_text())
    assert len(m["shards"]) == 1 and m["dtype"] == "uint16"
    LIES[lie](m, m["shards"][0])
    m["manifest_xxh3"] = manifest_checksum(m)  # the fingerprint covers checksums, not counts
    atomic_write_json(store / "manifest.json", m)
    (tmp_path / "train.py").write_text(LYING_LOADER)
    r = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(store)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    named = (f"{store}/manifest.json: totals" if "totals" in lie else
             f"{store}/shard-00000.{'bin: expected' if 'bytes' in lie else 'idx: holds'}")
    for layout, line in zip(("concat", "packed"), r.stdout.splitlines(), strict=True):
        assert line.startswith(f"{layout} raised StoreError: {named}"), r.stdout[:2000]
        assert "tokenmill verify" in line
    assert verify_store(store)  # verify finds it too


@pytest.mark.parametrize("edit", ["fingerprint", "eos_id"])
def test_verify_recomputes_the_fingerprint(prepared_store, tmp_path, edit):
    """A manifest whose fingerprint no longer matches its tokenizer, dtype and shard checksums
    (edited, checksum recomputed): resume states and caches keyed on it would trust it."""
    store = tmp_path / "store"
    store.mkdir()
    for p in prepared_store.iterdir():
        (store / p.name).write_bytes(p.read_bytes())
    m = json.loads((store / "manifest.json").read_text())
    honest = m["fingerprint"]
    if edit == "fingerprint":
        m["fingerprint"] = "0123456789abcdef"
    else:
        m["tokenizer"]["eos_id"] += 1
    m["manifest_xxh3"] = manifest_checksum(m)
    atomic_write_json(store / "manifest.json", m)
    r = subprocess.run([sys.executable, "-m", "tokenmill", "verify", str(store)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1, r.stdout
    got, want = (("0123456789abcdef", honest) if edit == "fingerprint" else
                 (honest, tokenmill.store.store_fingerprint(m)))
    assert r.stdout.splitlines()[0] == (
        f"BAD  {store}/manifest.json: fingerprint {got!r}, but its tokenizer, dtype and shard "
        f"checksums give {want!r} (damaged, or edited)"), r.stdout


def test_index_entries_read_in_spans_equal_the_whole_index(tmp_path):
    from conftest import write_token_store
    from tokenmill.store.format import IDX_GAP, IDX_HEADER, read_idx, read_idx_entries
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 50, 5000)  # empty documents too
    write_token_store(tmp_path / "s", np.zeros(int(lengths.sum())), lengths)
    idx = tmp_path / "s" / "shard-00000.idx"
    whole = read_idx(idx, in_memory=True)
    cases = [np.array([3]), np.array([4999, 0, 4999, 7]), np.arange(0, 5000, 3),
             np.arange(0, 5000, IDX_GAP + 1), rng.integers(0, 5000, 700), np.array([5000, 9999]),
             np.array([], np.int64)]
    for ids in cases:
        got = read_idx_entries(idx, ids)
        want = np.minimum(ids, 4999)  # past the end: read as the last document
        assert got.num_documents == 5000 and got.num_tokens == int(lengths.sum())
        assert np.array_equal(got.lengths, whole.lengths[want])
        assert np.array_equal(got.pointers, whole.pointers[want])
    # a length damaged in the middle of a span is caught, naming the file and the documents
    raw = bytearray(idx.read_bytes())
    struct.pack_into("<i", raw, IDX_HEADER.size + 4 * 2500, int(lengths[2500]) + 1)
    idx.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"shard-00000\.idx: documents .* offsets and lengths "
                                         r"disagree"):
        read_idx_entries(idx, np.arange(2400, 2600, 7))
    with pytest.raises(StoreError, match="offsets and lengths disagree"):
        read_idx_entries(idx, np.arange(0, 5000, 2))  # most of the file: read whole
    # among many spans (checked all at once) the message names the damaged one's documents
    with pytest.raises(StoreError, match=r"documents 2,500\.\.2,500: offsets and lengths"):
        read_idx_entries(idx, np.array([10, 1000, 2500, 4000]))
    assert read_idx_entries(idx, np.array([10, 1000, 4000])).num_documents == 5000  # elsewhere
    struct.pack_into("<q", raw, IDX_HEADER.size + 4 * 5000, 2)  # the first document's offset
    idx.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"documents 0\.\.0: offsets and lengths"):
        read_idx_entries(idx, np.array([0, 3000]))


@pytest.mark.parametrize("shards", [1, 3])
def test_doc_spans_of_a_damaged_index_raise_when_the_index_is_mapped_for_them(tmp_path, shards):
    # two documents' offsets swapped (the counts intact: the manifest check passes): spans of a
    # quarter of a shard or more map its index; they must raise naming the file, as the spans
    # read alone do, never give the swapped starts (nothing else reads the .bin to checksum it)
    from conftest import write_positional_store
    from tokenmill.store.format import IDX_HEADER
    write_positional_store(tmp_path / "s", np.full(3000, 10), shard_tokens=30_000 // shards)
    idx = tmp_path / "s" / "shard-00000.idx"
    n = 3000 // shards
    raw = bytearray(idx.read_bytes())
    a, b = struct.unpack_from("<qq", raw, IDX_HEADER.size + 4 * n + 8 * 5)
    struct.pack_into("<qq", raw, IDX_HEADER.size + 4 * n + 8 * 5, b, a)
    idx.write_bytes(bytes(raw))
    with TokenStore(tmp_path / "s") as store:
        for ids in (np.arange(0, 100), np.arange(0, n), np.arange(0, n)):  # alone; mapped; again
            with pytest.raises(StoreError, match=r"shard-00000\.idx: documents .* offsets and "
                                                 r"lengths disagree"):
                store.doc_spans(ids)
    with TokenStore(tmp_path / "s") as store:  # the index mapped first by a document read
        store[0]
        for ids in (np.arange(0, 100), np.arange(0, n)):
            with pytest.raises(StoreError, match=r"shard-00000\.idx: documents .* offsets and "
                                                 r"lengths disagree"):
                store.doc_spans(ids)
