"""Remote stores and inputs against a real S3-compatible server (moto) on 127.0.0.1, with s3fs.

Covers: prepare from S3 (and plain HTTP) inputs, prepare --out s3://… (manifest last, resume
after SIGKILL), reading a remote store through the shard cache (LRU eviction, pinned shards never
evicted, prefetch), a download killed mid-way, a corrupt object caught by its checksum, two
processes sharing one cache directory, a manifest lying about a shard's counts, and what a remote
start costs in requests, counted at the server.
"""

import gzip
import json
import os
from collections import Counter
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

import moto.server  # noqa: F401  (dev dependencies: a missing one is a broken install,
import s3fs  # noqa: F401  not a skip; the moto fixtures `s3`, `s3_endpoint` are in conftest)

import tokenmill  # noqa: E402
from conftest import store_bytes, write_jsonl, write_positional_store  # noqa: E402
from tokenmill.base.io import json_bytes, list_sizes  # noqa: E402
from tokenmill.base.errors import ConfigError, StoreError  # noqa: E402
from tokenmill.prepare import prepare  # noqa: E402
from tokenmill.inputs.sources import SourceConfig, read_documents  # noqa: E402
from tokenmill.store import TokenStore, verify_store  # noqa: E402
from tokenmill.store import cache, upload  # noqa: E402
from tokenmill.store.cache import CacheFullError, ShardCache  # noqa: E402
from tokenmill.store.format import manifest_checksum  # noqa: E402

DOC = 500  # tokens per document of the positional stores
BIN = 8 * DOC * 4  # 8 int32 documents per shard: 16,000 bytes


@pytest.fixture
def remote_store(s3, tmp_path):
    """A 4-shard positional store (token p == p, int32), uploaded; returns (url, local path)."""
    local = write_positional_store(tmp_path / "local-store", [DOC] * 32, shard_tokens=8 * DOC)
    return s3.put_dir(local, "store"), local


def idx_total(local: Path) -> int:
    return sum(p.stat().st_size for p in local.glob("*.idx"))


def cache_files(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "shards").iterdir() if not p.name.startswith("."))


# ---- prepare: inputs in a bucket, out to a bucket --------------------------------------------

def test_prepare_from_s3_and_http_inputs_equals_local(s3, tmp_path, real_texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    src = tmp_path / "in"
    src.mkdir()
    texts = real_texts[:60]
    write_jsonl(src / "a.jsonl", texts[:20])
    (src / "b.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[20:35]).encode()))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[35:45]).encode()))
    pq.write_table(pa.table({"text": texts[45:]}), src / "d.parquet", row_group_size=4)
    s3.put_dir(src, "in")
    opts = dict(workers=2, progress=False, unit_bytes=20_000, shard_tokens=40_000)
    local = prepare([str(src)], out=tmp_path / "local", **opts)
    remote_ = prepare([s3.url("in/")], out=tmp_path / "remote", **opts)
    assert remote_["num_documents"] == local["num_documents"] == len(texts)
    assert remote_["shards"] == local["shards"]  # byte-identical shards, by checksum
    globbed = prepare([s3.url("in/*.jsonl")], out=tmp_path / "glob", **opts)
    assert globbed["num_documents"] == 20

    # a plain HTTP(S) URL: the same bucket object, made public, read through fsspec's http
    s3.fs.chmod(f"{s3.bucket}/in/a.jsonl", acl="public-read")
    http = f"{s3.endpoint}/{s3.bucket}/in/a.jsonl"
    from_http = prepare([http], out=tmp_path / "http", **opts)
    assert from_http["shards"] == globbed["shards"]


def test_txt_paragraphs_over_s3_byte_ranges_match_local(s3, tmp_path, real_texts):
    text = "\n\n".join(real_texts[:40])
    (tmp_path / "p.txt").write_text(text)
    s3.fs.put_file(str(tmp_path / "p.txt"), f"{s3.bucket}/p.txt")
    cfg = SourceConfig(txt_mode="paragraphs", unit_bytes=30_000)
    local = list(read_documents(str(tmp_path / "p.txt"), cfg))
    over_s3 = list(read_documents(s3.url("p.txt"), cfg))
    assert len(local) > 1000 and over_s3 == local


def _subprocess_env() -> dict:
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]  # the tokenmill tested
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))


def test_prepare_to_s3_uploads_shards_manifest_last_and_resumes_after_sigkill(s3, tmp_path,
                                                                              real_texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", real_texts[:150])
    opts = dict(workers=1, progress=False, shard_tokens=60_000, unit_bytes=50_000)
    ref = prepare([str(corpus)], out=tmp_path / "ref", **opts)
    assert len(ref["shards"]) >= 6
    out = s3.url("out/store")
    # a run killed (SIGKILL) while uploading the .idx of shard 3: shards 0-2 are committed,
    # shard 3's .bin is in the bucket but never committed, and there is no manifest
    script = textwrap.dedent(f"""
        import os, signal
        from tokenmill import prepare
        from tokenmill.store.upload import RemoteOut
        real = RemoteOut.upload_shard
        def upload(self, staging, info):
            if info.name == "shard-00003":
                self.fs.put_file(str(staging / (info.name + ".bin")), self._rpath(info.name + ".bin"))
                os.kill(os.getpid(), signal.SIGKILL)
            real(self, staging, info)
        RemoteOut.upload_shard = upload
        prepare([{str(corpus)!r}], out={out!r}, **{opts!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_subprocess_env())
    assert proc.returncode == -signal.SIGKILL
    left = s3.objects("out/store")
    assert "manifest.json" not in left and "shard-00003.bin" in left and "shard-00002.idx" in left
    with pytest.raises(StoreError, match="prepare did not finish"):
        TokenStore(out, cache_dir=tmp_path / "cache")

    uploads = []
    real = upload.RemoteOut.upload_shard

    def counting(self, staging, info):
        uploads.append(info.name)
        # the manifest goes last: it is not there while any shard is being uploaded
        assert "manifest.json" not in list_sizes(self.url, None)
        real(self, staging, info)

    upload.RemoteOut.upload_shard = counting
    try:
        again = prepare([str(corpus)], out=out, **opts)
    finally:
        upload.RemoteOut.upload_shard = real
    assert uploads[0] == "shard-00003", "the rerun did not resume after the committed shards"
    assert again == ref
    assert s3.objects("out/store") == store_bytes(tmp_path / "ref")  # byte-identical store
    staging = cache.default_cache_dir() / "staging" / cache.url_key(out)
    assert not staging.exists()

    # finished: a rerun is a no-op, other settings are refused unless overwrite
    assert prepare([str(corpus)], out=out, **opts) == ref
    with pytest.raises(ConfigError, match="other settings"):
        prepare([str(corpus)], out=out, **{**opts, "shard_tokens": 90_000})
    replaced = prepare([str(corpus)], out=out, overwrite=True, **{**opts, "shard_tokens": 90_000})
    assert set(s3.objects("out/store")) == {"manifest.json"} | {
        f"{s['name']}{e}" for s in replaced["shards"] for e in (".bin", ".idx", ".src")}
    assert verify_store(out) == []


# ---- reading a remote store through the cache ------------------------------------------------

def test_remote_store_reads_exactly_and_loader_batches_match_local(remote_store, tmp_path):
    url, local = remote_store
    with TokenStore(url, cache_dir=tmp_path / "cache") as st, TokenStore(local) as ref:
        assert st.fingerprint == ref.fingerprint and len(st) == len(ref) == 32
        assert np.array_equal(st.tokens(0, st.num_tokens), np.arange(st.num_tokens))
        assert np.array_equal(st[13], ref[13])
        assert st.open_args()["path"] == url
        import pickle
        again = pickle.loads(pickle.dumps(st))  # pickles as how to reopen it: same cache
        assert again.local_dir == st.local_dir and np.array_equal(again[31], ref[31])
        loaders = [tokenmill.Loader(s, seq_len=100, batch_size=4, num_workers=0, seed=3)
                   for s in (st, ref)]
        for _, a, b in zip(range(10), *loaders):
            assert np.array_equal(a["inputs"], b["inputs"])
            assert np.array_equal(a["targets"], b["targets"])
        assert loaders[0].fingerprint == loaders[1].fingerprint


def test_a_store_larger_than_the_cache_is_read_through_it(remote_store, tmp_path):
    url, local = remote_store
    limit = idx_total(local) + 2 * BIN  # room for two of the four shards
    ref = TokenStore(local)
    with TokenStore(url, cache_dir=tmp_path / "cache", cache_bytes=limit) as st:
        rng = np.random.default_rng(0)
        for s in rng.integers(0, st.num_tokens - 100, 200).tolist():  # all over, many times
            assert np.array_equal(st.tokens(s, s + 100), np.arange(s, s + 100))
            assert ShardCache(tmp_path / "cache", limit).usage() <= limit
        loaders = [tokenmill.Loader(x, seq_len=100, batch_size=4, num_workers=0, seed=3)
                   for x in (st, ref)]
        for _, a, b in zip(range(30), *loaders):  # shards are mapped on demand, a few at a time
            assert np.array_equal(a["inputs"], b["inputs"])
        for loader in loaders:
            loader.close()


def test_credentials_from_storage_options_alone(remote_store, s3, tmp_path, monkeypatch):
    url, _ = remote_store
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: unused
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    opts = {"key": "testing", "secret": "testing", "endpoint_url": s3.endpoint,
            "skip_instance_cache": True}
    with TokenStore(url, cache_dir=tmp_path / "cache", storage_options=opts) as st:
        assert int(st.tokens(15_000, 15_001)[0]) == 15_000
        assert st.open_args()["storage_options"] == opts


def test_explain_reads_a_remote_stores_sidecars_with_its_storage_options(s3, tmp_path,
                                                                          monkeypatch):
    texts = [f"document {i} " + "word " * (40 + i % 7) for i in range(60)]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    prepare([str(src)], out=tmp_path / "local", shard_tokens=2_000)
    url = s3.put_dir(tmp_path / "local", "explained")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: unused
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    opts = {"key": "testing", "secret": "testing", "endpoint_url": s3.endpoint,
            "skip_instance_cache": True}
    with TokenStore(url, cache_dir=tmp_path / "cache", storage_options=opts) as st, \
            tokenmill.Loader(st, seq_len=64, batch_size=2, num_workers=0) as ld:
        pieces = [p for k in range(3) for row in ld.explain(k) for p in row.pieces]
    assert pieces and all(p.file == str(src) and "unknown" not in p.source for p in pieces), \
        pieces[:3]
    for p in pieces:  # the line a piece names holds the document it came from
        assert texts[p.line - 1].startswith(f"document {p.line - 1} ")


def test_shard_cache_evicts_least_recently_used_and_never_a_pinned_file(s3, tmp_path):
    rng = np.random.default_rng(0)
    blobs = {k: rng.integers(0, 256, 1000, dtype=np.uint8).tobytes() for k in "abcde"}
    for k, data in blobs.items():
        s3.fs.pipe_file(f"{s3.bucket}/o/{k}.bin", data)
    key = {k: (s3.url(f"o/{k}.bin"), 1000, xxhash.xxh3_64_hexdigest(d)) for k, d in blobs.items()}
    cache = ShardCache(tmp_path / "cache", 3000)

    def held() -> list[str]:
        return [next(k for k in key if ShardCache.entry_name(*key[k]) == e.name)
                for e in cache.entries()]  # least recently used first

    for k in "abc":
        assert Path(cache.fetch(*key[k])).read_bytes() == blobs[k]
    cache.fetch(*key["a"])  # a is used again: b is now the least recently used
    assert held() == ["b", "c", "a"]
    cache.fetch(*key["d"])
    assert held() == ["c", "a", "d"] and cache.usage() <= 3000
    with cache.pin(*key["c"]) as pin:  # pinning is a use: c is now the most recently used
        cache.fetch(*key["a"])
        cache.fetch(*key["d"])
        assert held() == ["c", "a", "d"]
        cache.fetch(*key["e"])  # c is the least recently used, but pinned: a goes instead
        assert held() == ["c", "d", "e"] and pin.path.read_bytes() == blobs["c"]
        assert [e.pinned for e in cache.entries()] == [True, False, False]
        with cache.pin(*key["d"]), cache.pin(*key["e"]):
            with pytest.raises(CacheFullError, match="pinned"):
                cache.fetch(*key["a"])
    cache.fetch(*key["a"])  # c is unpinned again, and least recently used
    assert held() == ["d", "e", "a"]
    with pytest.raises(CacheFullError, match="more than the whole cache"):
        ShardCache(tmp_path / "small", 999).fetch(*key["a"])


class HeldAtTheEnd:
    """A remote stream of ``size`` bytes that, once every byte is read, sets ``done`` and waits
    for ``go`` before handing out the last ones."""

    def __init__(self, f, size: int, done: threading.Event, go: threading.Event):
        self.f, self.left, self.done, self.go = f, size, done, go

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()

    def read(self, n):
        data = self.f.read(n)
        self.left -= len(data)
        if self.left <= 0:
            self.done.set()
            assert self.go.wait(30)
        return data


def test_a_download_landing_while_an_eviction_pass_counts_is_counted(s3, tmp_path, monkeypatch):
    """A download renamed into place between an eviction pass's listing and its stats was once
    counted under neither name, and a third file came in where two fit (CI saw 48,000 bytes
    held against a 32,808-byte limit)."""
    blobs = {k: k.encode() * 1000 for k in "abc"}
    for k, data in blobs.items():
        s3.fs.pipe_file(f"{s3.bucket}/o/{k}.bin", data)
    key = {k: (s3.url(f"o/{k}.bin"), 1000, xxhash.xxh3_64_hexdigest(d)) for k, d in blobs.items()}
    names = {k: ShardCache.entry_name(*key[k]) for k in key}
    shards = ShardCache(tmp_path / "cache", 2000)
    shards.fetch(*key["c"])  # cached, unpinned: the one to evict when b comes
    downloaded, go, landing = threading.Event(), threading.Event(), threading.Event()
    real_open, real_lock = cache._open_remote, cache.lock_file

    def lock_file(path, **kw):  # a asking for the cache's lock to land: as far as it can go
        if (threading.current_thread() is lands and downloaded.is_set()
                and Path(path).name == ".lock"):
            landing.set()
        return real_lock(path, **kw)

    class ListsThenLetsALand(type(shards.dir)):
        def iterdir(self):
            listed = list(super().iterdir())
            if not go.is_set():  # the first listing: b's eviction pass
                go.set()
                assert landing.wait(30)
            return iter(listed)

    monkeypatch.setattr(cache, "_open_remote", lambda fs, p, size: HeldAtTheEnd(
        real_open(fs, p, size), size, downloaded, go) if p.endswith("/a.bin")
        else real_open(fs, p, size))
    monkeypatch.setattr(cache, "lock_file", lock_file)
    lands = threading.Thread(target=lambda: (shards.fetch(*key["a"]), landing.set()))
    lands.start()
    assert downloaded.wait(30)
    other = ShardCache(tmp_path / "cache", 2000)  # another reader of the same directory
    other.dir = ListsThenLetsALand(other.dir)
    other.fetch(*key["b"])
    lands.join(30)
    assert sorted(e.name for e in shards.entries()) == sorted([names["a"], names["b"]])
    assert shards.usage() == 2000


def test_a_download_that_just_landed_is_evictable_at_once(s3, tmp_path, monkeypatch):
    """A download waited for by another (the cache full of it and a pinned file) was once
    renamed into place with its entry still locked: the waiter's next pass took it for pinned,
    saw nothing in flight, and raised CacheFullError instead of evicting it."""
    blobs = {k: k.encode() * 1000 for k in "abc"}
    for k, data in blobs.items():
        s3.fs.pipe_file(f"{s3.bucket}/o/{k}.bin", data)
    key = {k: (s3.url(f"o/{k}.bin"), 1000, xxhash.xxh3_64_hexdigest(d)) for k, d in blobs.items()}
    shards = ShardCache(tmp_path / "cache", 2000)
    downloaded, go, landed, passed = (threading.Event() for _ in range(4))
    real_open, real_lock, real_unlock = cache._open_remote, cache.lock_file, cache.unlock
    real_pass = ShardCache._evict_until
    global_fds, lands = set(), None

    def lock_file(path, **kw):
        fd = real_lock(path, **kw)
        if threading.current_thread() is lands and downloaded.is_set() and \
                Path(path).name == ".lock":
            global_fds.add(fd)
        return fd

    def unlock(fd):  # a lets go of the cache's lock after landing: b's next pass runs now
        if threading.current_thread() is not lands or fd not in global_fds:
            return real_unlock(fd)
        global_fds.discard(fd)
        landed.set()
        real_unlock(fd)
        assert passed.wait(30)

    def evict_until(self, target):
        try:
            return real_pass(self, target)
        finally:
            if threading.current_thread() is not lands and downloaded.is_set():
                (passed if landed.is_set() else go).set()  # b waits for a, then for a's landing

    monkeypatch.setattr(cache, "_open_remote", lambda fs, p, size: HeldAtTheEnd(
        real_open(fs, p, size), size, downloaded, go) if p.endswith("/a.bin")
        else real_open(fs, p, size))
    monkeypatch.setattr(cache, "lock_file", lock_file)
    monkeypatch.setattr(cache, "unlock", unlock)
    monkeypatch.setattr(ShardCache, "_evict_until", evict_until)
    with shards.pin(*key["c"]):  # c: held by a reader; a and b share the other 1,000 bytes
        lands = threading.Thread(target=shards.fetch, args=key["a"])
        lands.start()
        assert downloaded.wait(30)
        shards.fetch(*key["b"])  # waits for a to land, then evicts it
        lands.join(30)
        names = sorted(e.name for e in shards.entries())
        assert names == sorted(ShardCache.entry_name(*key[k]) for k in "bc")
        assert shards.usage() == 2000


def test_mapped_shard_is_never_evicted_and_is_released_with_its_last_view(remote_store, tmp_path):
    url, local = remote_store
    cache_dir = tmp_path / "cache"
    limit = idx_total(local) + 2 * BIN + BIN // 2  # room for two of the four shards
    st = TokenStore(url, cache_dir=cache_dir, cache_bytes=limit)
    cache = ShardCache(cache_dir, limit)  # another handle on the same directory
    bin0 = ShardCache.entry_name(f"{url}/shard-00000.bin", BIN, st.manifest["shards"][0]["bin_xxh3"])
    doc = st[3]  # a view into shard 0: the shard stays mapped and pinned while it lives
    for _ in range(2):
        for i in (1, 2, 3, 1, 3, 2):
            assert np.array_equal(st.tokens(i * 4000, (i + 1) * 4000),
                                  np.arange(i * 4000, (i + 1) * 4000))
            assert (cache_dir / "shards" / bin0).exists()
            assert cache.usage() <= limit
    assert np.array_equal(doc, np.arange(3 * DOC, 4 * DOC))
    assert {e.name: e.pinned for e in cache.entries()}[bin0]
    st.close()
    del doc  # the last view: the shard is unpinned and may go
    assert not {e.name: e.pinned for e in cache.entries()}[bin0]
    st = TokenStore(url, cache_dir=cache_dir, cache_bytes=limit)
    for i in (1, 2, 3):
        st.tokens(i * 4000, i * 4000 + 1)
    st.close()
    assert not (cache_dir / "shards" / bin0).exists()


def test_prefetch_fills_the_cache_in_the_background_and_a_read_fetches_only_its_shard(
        remote_store, tmp_path):
    url, _ = remote_store
    with TokenStore(url, cache_dir=tmp_path / "c1") as st:
        assert cache_files(tmp_path / "c1") == []  # opening fetches nothing: the manifest only
        paths = st.prefetch().result(timeout=30)
        assert [Path(p).stat().st_size for p in paths] == [BIN] * 4
    with TokenStore(url, cache_dir=tmp_path / "c2") as st:
        st.shard(2)  # its .idx (checked against the manifest) and its .bin, nothing else
        s = st.manifest["shards"][2]
        want = {ShardCache.entry_name(f"{url}/shard-00002{ext}", s[f"{ext[1:]}_bytes"],
                                      s[f"{ext[1:]}_xxh3"]) for ext in (".bin", ".idx")}
        st.close()
        assert [f for f in cache_files(tmp_path / "c2") if not f.endswith(".lock")] == sorted(want)
    local = remote_store[1]
    with TokenStore(local) as st:
        assert st.prefetch().result() == [] and st.local_dir == local


# ---- failures: an interrupted download, a corrupt object ---------------------------------------

def test_download_interrupted_midway_leaves_no_usable_file(remote_store, tmp_path, monkeypatch):
    url, _ = remote_store
    cache_dir = tmp_path / "cache"
    shard = TokenStore(url, cache_dir=cache_dir).manifest["shards"][2]
    args = (f"{url}/shard-00002.bin", BIN, shard["bin_xxh3"])
    name = ShardCache.entry_name(*args)
    # 1. a process killed (SIGKILL) in the middle of the download
    script = textwrap.dedent(f"""
        import sys, time
        from tokenmill.store import cache
        cache._CHUNK = 4096
        real = cache._open_remote
        class Stalls:
            def __init__(self, f): self.f, self.n = f, 0
            def __enter__(self): return self
            def __exit__(self, *a): self.f.close()
            def read(self, n):
                self.n += 1
                if self.n == 2:
                    print("started", flush=True)
                    time.sleep(600)
                return self.f.read(n)
        cache._open_remote = lambda *a: Stalls(real(*a))
        cache.ShardCache({str(cache_dir)!r}, 1 << 30).fetch(*{args!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=_subprocess_env())
    try:
        assert proc.stdout.readline().strip() == "started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    files = cache_files(cache_dir)
    assert name not in files and any(f.startswith(f"{name}.tmp-") for f in files)  # debris left
    st = TokenStore(url, cache_dir=cache_dir)  # the next open downloads it again, whole
    assert np.array_equal(st.shard(2), np.arange(8000, 12000))
    st.close()
    assert name in cache_files(cache_dir) and not any(".tmp-" in f for f in cache_files(cache_dir))

    # 2. a stream that fails part-way: an error naming the URL, nothing left behind
    cache_dir2 = tmp_path / "cache2"
    monkeypatch.setattr(cache, "_CHUNK", 4096)
    real = cache._open_remote

    class Breaks:
        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def read(self, n):
            self.n += 1
            if self.n == 3:
                raise ConnectionResetError("connection reset by peer")
            return self.f.read(n)

    monkeypatch.setattr(cache, "_open_remote", lambda *a: Breaks(real(*a)))
    with pytest.raises(StoreError, match="shard-00002.bin: download failed .ConnectionResetError"):
        ShardCache(cache_dir2, 1 << 30).fetch(*args)
    assert [f for f in cache_files(cache_dir2) if not f.endswith(".lock")] == []
    monkeypatch.setattr(cache, "_open_remote", real)
    assert Path(ShardCache(cache_dir2, 1 << 30).fetch(*args)).stat().st_size == BIN


def test_corrupt_object_is_caught_by_its_checksum(remote_store, s3, tmp_path):
    url, local = remote_store
    key = f"{s3.bucket}/store/shard-00001.bin"
    data = bytearray(s3.fs.cat_file(key))
    data[5000] ^= 0xFF  # same size, one flipped byte
    s3.fs.pipe_file(key, bytes(data))
    st = TokenStore(url, cache_dir=tmp_path / "cache")  # sizes agree: opening succeeds
    assert np.array_equal(st.shard(0), np.arange(4000))
    with pytest.raises(StoreError, match=rf"{url}/shard-00001.bin: shard file shard-00001.bin "
                                         r"fails its checksum"):
        st.shard(1)
    assert not any(f.endswith(".bin") and st.manifest["shards"][1]["bin_xxh3"] in f
                   for f in cache_files(tmp_path / "cache"))
    problems = verify_store(url)
    assert len(problems) == 1 and "shard-00001.bin" in problems[0] and "checksum" in problems[0]
    s3.fs.pipe_file(key, bytes(data[:-4]))  # a truncated object is caught when read, by size
    st = TokenStore(url, cache_dir=tmp_path / "cache")
    with pytest.raises(StoreError, match=r"shard-00001.bin: shard file shard-00001.bin has 15,996 "
                                         r"bytes, the manifest records 16,000"):
        st.shard(1)


def test_a_remote_manifest_that_lies_about_a_shards_tokens_is_refused_naming_it(remote_store,
                                                                                  s3, tmp_path):
    url, _ = remote_store
    key = f"{s3.bucket}/store/manifest.json"
    m = json.loads(s3.fs.cat_file(key))
    m["shards"][1]["num_tokens"] += 3  # and the totals, and the checksum: it parses as valid
    m["num_tokens"] += 3
    m["manifest_xxh3"] = manifest_checksum(m)
    s3.fs.pipe_file(key, json_bytes(m))
    with TokenStore(url, cache_dir=tmp_path / "cache") as st:
        assert np.array_equal(st.tokens(0, 100), np.arange(100))  # shard 0 tells the truth
        with pytest.raises(StoreError, match=rf"{url}/shard-00001.idx: holds 8 int32 documents of "
                                             r"4,000 tokens, the manifest says 8 int32 documents "
                                             r"of 4,003 tokens; .*run 'tokenmill verify'"):
            st.tokens(4000, 4100)
    with tokenmill.Loader(url, seq_len=100, batch_size=4, cache_dir=tmp_path / "layouts") as ld:
        with pytest.raises(StoreError, match=rf"{url}/shard-00001.idx: holds"):
            for _ in zip(range(1000), ld):  # more than an epoch
                pass


# ---- several processes, one cache ------------------------------------------------------------

def test_two_processes_share_one_cache_directory(remote_store, tmp_path):
    url, local = remote_store
    cache_dir = tmp_path / "shared-cache"
    limit = idx_total(local) + 3 * BIN  # less than the store: the readers evict each other's
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from tokenmill import TokenStore
        seed = int(sys.argv[1])
        rng = np.random.default_rng(seed)
        st = TokenStore({url!r}, cache_dir={str(cache_dir)!r}, cache_bytes={limit})
        for _ in range(40):
            i = int(rng.integers(0, 4))
            a = int(rng.integers(0, 3900))
            got = np.array(st.tokens(i * 4000 + a, i * 4000 + a + 100))
            assert np.array_equal(got, np.arange(i * 4000 + a, i * 4000 + a + 100)), (i, a)
        print("ok", flush=True)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_subprocess_env())
             for seed in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "ok", err
    files = cache_files(cache_dir)
    assert not any(".tmp-" in f for f in files), files
    cache = ShardCache(cache_dir, limit)
    assert cache.usage() <= limit
    for e in cache.entries():  # whatever is left is complete and verified
        assert not e.pinned and e.name.split("-")[0] == xxhash.xxh3_64_hexdigest(
            (cache_dir / "shards" / e.name).read_bytes())


def test_inspect_and_verify_a_remote_store_show_its_url_intact(remote_store):
    url, _ = remote_store
    for args in (["inspect", url], ["inspect", url + "/", "--json"], ["verify", url]):
        r = subprocess.run([str(Path(sys.executable).with_name("tokenmill")), *args],
                           capture_output=True, text=True, timeout=300, env=_subprocess_env())
        assert r.returncode == 0, r.stderr
        assert url in r.stdout and url.replace("s3://", "s3:/") not in r.stdout  # a Path() of it
    first = subprocess.run([str(Path(sys.executable).with_name("tokenmill")), "inspect", url],
                           capture_output=True, text=True, timeout=300, env=_subprocess_env())
    assert first.stdout.splitlines()[0] == f"store        {url}"  # not "s3:/bucket/store"


# ---- what a remote start costs, counted at the server -------------------------------------------

@pytest.fixture
def counted_s3(s3, monkeypatch):
    """The test's bucket served through a second endpoint that logs every request it gets.

    The endpoint is a werkzeug server running moto's own S3 application in this process, so it
    sees the same buckets as the session's server; AWS_ENDPOINT_URL points at it for this test
    (child processes inherit it). Counting at the server is what the issue counts — requests on
    the wire, from any process and any client library, retries included — where a client-side
    hook (botocore events, s3fs) would miss another process's requests and count a cached
    answer as one. Returns ``(s3, log)``: ``log`` is a list of (method, key, query) of this
    bucket, in arrival order."""
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server
    log: list[tuple[str, str, str]] = []
    app = DomainDispatcherApplication(create_backend_app)
    prefix = f"/{s3.bucket}"

    def logging_app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == prefix or path.startswith(prefix + "/"):
            log.append((environ["REQUEST_METHOD"], path[len(prefix) + 1:],
                        environ.get("QUERY_STRING", "")))
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, logging_app, threaded=True,
                         request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://%s:%d" % server.server_address[:2])
    yield s3, log
    server.shutdown()
    thread.join()


def operations(log: list[tuple[str, str, str]], store: str) -> list[str]:
    """Each logged request as 'LIST prefix', 'HEAD name' or 'GET name' (names inside ``store``),
    sorted."""
    ops = []
    for method, key, query in log:
        listing = method == "GET" and ("list-type" in query or "prefix=" in query or not key)
        name = key.removeprefix(f"{store}/")
        ops.append(f"LIST {query}" if listing else f"{method} {name}")
    return sorted(ops)


def tiny_shard_store(shards: int) -> dict[str, bytes]:
    """The files of a positional int32 store (token p is p) of ``shards`` shards of 64 tokens,
    made in memory (~0.1 s for 1,000 shards): 4 documents a shard, cut differently in each, so no
    two .idx are alike (the cache would fetch a shared one once)."""
    from tokenmill.store import ShardInfo, build_manifest, idx_bytes, shard_name
    rng, cuts = np.random.default_rng(0), set()
    while len(cuts) < shards:
        cuts.add(tuple(sorted(rng.choice(np.arange(1, 64), 3, replace=False).tolist())))
    files, infos = {}, []
    for i, c in enumerate(sorted(cuts)):
        name = shard_name(i)
        data = np.arange(64 * i, 64 * (i + 1), dtype=np.int32).tobytes()
        idx = idx_bytes(np.diff((0, *c, 64)), np.int32)
        files.update({f"{name}.bin": data, f"{name}.idx": idx})
        infos.append(ShardInfo(name, 4, 64, len(data), len(idx), xxhash.xxh3_64_hexdigest(data),
                               xxhash.xxh3_64_hexdigest(idx)))
    manifest = build_manifest(tokenizer={"kind": "positional", "vocab_size": 1 << 31},
                              dtype=np.int32, shards=infos, settings={}, skipped={"total": 0})
    files["manifest.json"] = json_bytes(manifest)
    return files


def test_a_remote_start_costs_the_manifest_and_the_files_the_first_batch_reads(counted_s3):
    """1,000 shards on S3; a fresh process's Loader and its first batch (concat layout): the
    server sees the manifest GET and one GET of the .idx and of the .bin of each shard that
    batch's rows hold tokens of (known from the tokens themselves: token p of this store is p),
    nothing else — no LIST, no HEAD, no request for any other shard. A second process sharing the
    cache reads the same batch with the manifest GET alone: the cache keeps copies named by the
    xxh3 and size the manifest records, verified when downloaded, so the manifest is all it
    needs to know they are the store's files."""
    s3, log = counted_s3
    files = tiny_shard_store(1000)
    s3.fs.pipe({f"{s3.bucket}/many/{name}": data for name, data in files.items()})  # at once
    url = s3.url("many")
    script = textwrap.dedent(f"""
        import json
        import tokenmill
        with tokenmill.Loader({url!r}, seq_len=100, batch_size=8, seed=5) as loader:
            batch = next(iter(loader))
        rows = [sorted(set(i.tolist()) | set(t.tolist()))
                for i, t in zip(batch["inputs"], batch["targets"])]
        print(json.dumps(rows))
    """)
    runs = []
    for _ in range(2):
        log.clear()
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=300, env=_subprocess_env())
        assert proc.returncode == 0, proc.stderr
        runs.append((json.loads(proc.stdout), operations(log, "many")))
    (rows, first), (again, second) = runs
    assert rows == again and all(r == list(range(r[0], r[0] + 101)) for r in rows)
    read = sorted({t // 64 for r in rows for t in r})
    assert 8 <= len(read) <= 24, read  # a row of 101 tokens lies in 2 or 3 shards of 64
    want = ["GET manifest.json"] + [f"GET shard-{i:05d}{ext}" for i in read
                                    for ext in (".bin", ".idx")]
    assert first == sorted(want), f"{tally(first)}, want {tally(want)}"
    assert second == ["GET manifest.json"], f"{tally(second)}"


def tally(ops: list[str]) -> dict[str, int]:
    """Requests by operation and file kind: {'GET .idx': 1000, 'LIST': 3, …}."""
    return dict(Counter("LIST" if op.startswith("LIST") else
                        f"{op.split()[0]} {os.path.splitext(op)[1]}" for op in ops))
