"""More than 2^32 tokens and more than 2^31 documents: no 32-bit overflow anywhere.

Failure class: 32-bit index overflow (int32 document or token indexes, sample ids or offsets that
wrap past 2^31 / 2^32 and read the wrong data, or crash).

A synthetic store built from sparse files: shard 0 holds three documents of 2^31 - 1, 2^31 - 1
and 2^20 + 7 tokens (the int32 length field caps a document at 2^31 - 1 tokens), 2^32 + 2^20 + 5
tokens in all; shard 1 holds 2^31 + 5 documents, all empty but the last five. Only the bytes the
test reads hold data: token p of the store is marker(p) wherever a sampled window, a document
edge or a shard edge lies, and 0 (a hole) elsewhere. The quick size writes the last entries of
shard 1's document index (0 … N, 17 GB, never read by tokenmill's reader) and leaves the rest a
hole; the soak size writes all of it and checks the whole index structure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from faults.conftest import SIZE, record
from faults.programs import digest
from tokenmill import Loader
from tokenmill.load import pack, sampler
from tokenmill.base.io import atomic_write_json
from tokenmill.store import (IDX_HEADER, IDX_MAGIC, IDX_VERSION, CODE_OF_DTYPE, ShardInfo,
                             TokenStore, build_manifest, idx_bytes)

BIG = 2**31 - 1
SHARD0 = np.array([BIG, BIG, 2**20 + 7], np.int64)
N1 = 2**31 + 5
TAIL1 = np.array([3, 2**17, 11, 1, 2**16 + 9], np.int64)  # the non-empty last docs of shard 1
T0, T1 = int(SHARD0.sum()), int(TAIL1.sum())
L = 1 << 16
U16 = np.dtype("<u2")
ZEROS = memoryview(bytes(64 << 20))


def marker(p) -> np.ndarray:
    """The uint16 token at global positions p: a hash of all 64 bits of p, never 0 (a hole)."""
    p = np.asarray(p, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return ((p * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) % np.uint64(65_000) + 1


def write_sparse(path: Path, size: int, pieces) -> str:
    """A file of ``size`` bytes: holes except ``pieces`` ((offset, bytes), increasing, disjoint);
    returns the xxh3-64 of the whole file, holes included, without reading it back."""
    h = xxhash.xxh3_64()
    pos = 0

    def zeros(n: int) -> None:
        while n > 0:
            k = min(n, len(ZEROS))
            h.update(ZEROS[:k])
            n -= k

    with open(path, "wb") as f:
        for off, data in pieces:
            assert off >= pos
            zeros(off - pos)
            f.seek(off)
            f.write(data)
            h.update(data)
            pos = off + len(data)
        zeros(size - pos)
        f.truncate(size)
    return h.hexdigest()


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def idx1_pieces(full: bool):
    """Shard 1's index: header, lengths (0 … 0, TAIL1), pointers, document index 0 … N1."""
    yield 0, IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, CODE_OF_DTYPE[np.dtype(np.uint16)], N1, N1 + 1)
    off = IDX_HEADER.size
    yield off + 4 * (N1 - 5), TAIL1.astype("<i4").tobytes()
    off += 4 * N1
    ptr = np.concatenate([[0], np.cumsum(TAIL1[:-1])]) * 2
    yield off + 8 * (N1 - 5), ptr.astype("<i8").tobytes()
    off += 8 * N1
    first = 0 if full else N1 + 1 - 1024
    for a in range(first, N1 + 1, 1 << 23):  # 64 MiB chunks of 0, 1, 2, …
        yield off + 8 * a, np.arange(a, min(a + (1 << 23), N1 + 1), dtype="<i8").tobytes()


class BigStores:
    """Store A (shards 0 and 1) and store B (shard 0 only, hard-linked), rewritten with markers."""

    def __init__(self, root: Path):
        self.a, self.b = root / "a", root / "b"
        for d in (self.a, self.b):
            d.mkdir()
        self.idx0 = idx_bytes(SHARD0, np.uint16)
        (self.a / "shard-00000.idx").write_bytes(self.idx0)
        idx1_size = IDX_HEADER.size + 12 * N1 + 8 * (N1 + 1)
        self.idx1_xxh3 = write_sparse(self.a / "shard-00001.idx", idx1_size,
                                      idx1_pieces(SIZE.full_index))
        self.bin1 = marker(np.arange(T0, T0 + T1)).astype(U16).tobytes()
        (self.a / "shard-00001.bin").write_bytes(self.bin1)
        self.windows: list[tuple[int, int]] = []
        self.mark([(0, 64), (BIG - 64, BIG + 64), (2 * BIG - 64, 2 * BIG + 64), (T0 - 64, T0)])
        self.finish()

    def mark(self, ranges) -> None:
        """Give global token ranges [a, b) of shard 0 their marker values (then finish())."""
        self.windows = merged(self.windows + [(a, min(b, T0)) for a, b in ranges if a < T0])

    def finish(self) -> None:
        pieces = ((2 * a, marker(np.arange(a, b)).astype(U16).tobytes()) for a, b in self.windows)
        bin0 = write_sparse(self.a / "shard-00000.bin", 2 * T0, pieces)
        for name in ("shard-00000.bin", "shard-00000.idx"):
            (self.b / name).unlink(missing_ok=True)
            os.link(self.a / name, self.b / name)
        s0 = ShardInfo("shard-00000", 3, T0, 2 * T0, len(self.idx0), bin0,
                       xxhash.xxh3_64_hexdigest(self.idx0))
        s1 = ShardInfo("shard-00001", N1, T1, 2 * T1, IDX_HEADER.size + 12 * N1 + 8 * (N1 + 1),
                       xxhash.xxh3_64_hexdigest(self.bin1), self.idx1_xxh3)
        tok = {"kind": "synthetic", "name": "marker", "vocab_size": 65_001, "eos_id": 0,
               "bos_id": None, "file_xxh3": None}
        for d, shards in ((self.a, [s0, s1]), (self.b, [s0])):
            atomic_write_json(d / "manifest.json", build_manifest(
                tokenizer=tok, dtype=U16, shards=shards, settings={}, skipped={"total": 0}))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return BigStores(tmp_path_factory.mktemp("big"))


def loader(store: Path, layout: str = "concat", **kw) -> Loader:
    return Loader(store, seq_len=L, batch_size=4, layout=layout, seed=7, rank=0, world_size=1,
                  dtype="int64", **kw)


def want_concat(addr: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.where(np.arange(addr, addr + L + 1) < T0 + T1,
                      marker(np.arange(addr, addr + L + 1)), 0).astype(np.int64)
    return tokens[:-1], tokens[1:]


def test_scale_more_than_2_32_tokens_and_2_31_documents_open_sample_resume_no_32bit_overflow(big):
    with TokenStore(big.a) as store:
        assert len(store) == 3 + N1 > 2**31 and store.num_tokens == T0 + T1 > 2**32
        # documents past 2^31, and past 2^32 tokens: found, whole, their own tokens
        for i, n in zip(range(3 + N1 - 5, 3 + N1), TAIL1):
            start = T0 + int(TAIL1[:i - (3 + N1 - 5)].sum())
            assert np.array_equal(store[i], marker(np.arange(start, start + n)))
        assert len(store[2**31]) == 0 and len(store[-6]) == 0
        edge = store.tokens(T0 - 3, T0 + 3)  # across the shard boundary past 2^32
        assert np.array_equal(edge, marker(np.arange(T0 - 3, T0 + 3)))
        assert np.array_equal(store[1][-5:], marker(np.arange(2 * BIG - 5, 2 * BIG)))

    # the sample order: every window of an epoch exactly once, over all 2^32+ tokens
    with loader(big.a, num_workers=0) as ld:
        n = ld.samples_per_epoch
        assert n == (T0 + T1 - L) // L
        for e in (0, 1, 2**24):  # epoch 2^24: 2^40 samples in
            pos = np.arange(e * n, (e + 1) * n, dtype=np.int64)
            _, addr = ld.plan.resolve(pos)
            offset = pack.concat_offset(L, seed=7, epoch=e)
            assert np.array_equal(np.sort(addr), offset + L * np.arange(n, dtype=np.int64)), e
            assert addr.max() > 2**32
        # consumed samples at which batches are read (each, and the one after): the start, an
        # epoch boundary inside the second batch, a resume point, 2^40 samples in
        checks = {"first": 0, "epoch edge": n - 6, "resume": n + 160, "2^40 in": 2**40 + 12}
        addrs = {c + k: ld.plan.resolve(ld.positions(c + k))[1]
                 for c in checks.values() for k in (0, 4)}
    big.mark([(int(a), int(a) + L + 1) for v in addrs.values() for a in v])

    # the packed layout of store B: pieces of the 2^31-token documents, starts past 2^32
    with TokenStore(big.b) as b:
        layout = pack.pack_documents(b.doc_lengths, L)
    pieces_per_big = (BIG - 2) // L + 1
    starts = layout.seg_start[layout.seg_doc == 1]
    assert np.array_equal(np.sort(starts), BIG + L * np.arange(pieces_per_big, dtype=np.int64))
    rows = [0, layout.num_rows // 2, layout.num_rows - 1]
    row_ranges = [(int(layout.seg_start[k]), int(layout.seg_start[k] + layout.seg_len[k]))
                  for r in rows for k in range(layout.row_ptr[r], layout.row_ptr[r + 1])]
    big.mark(row_ranges)
    big.finish()

    # read those batches through process workers, resume in a fresh Loader
    with loader(big.a, num_workers=2, worker_type="process") as ld:
        for name, c in checks.items():
            ld.load_state_dict({**ld.state_dict(), "consumed_samples": c})
            it = iter(ld)
            for k in (c, c + 4):
                batch = next(it)
                for row, a in enumerate(addrs[k].tolist()):
                    want_in, want_tg = want_concat(a)
                    assert np.array_equal(batch["inputs"][row], want_in), (name, row, a)
                    assert np.array_equal(batch["targets"][row], want_tg), (name, row, a)
            state = ld.state_dict()
            assert state["consumed_samples"] == c + 8
        json.loads(json.dumps(state))
    with loader(big.a, num_workers=0) as fresh:
        fresh.load_state_dict(state)
        assert digest(next(iter(fresh))) == digest(fresh.batch_at(state["consumed_samples"]))

    with loader(big.b, layout="packed", num_workers=1, worker_type="process") as ld:
        for r in rows:
            out = ld.plan.new_buffers(1)
            pack.fill_packed_rows(layout, np.array([r]), ld.plan.sources[0].store.tokens, out)
            want = np.zeros(L + 1, np.int64)
            at = 0
            for k in range(layout.row_ptr[r], layout.row_ptr[r + 1]):
                s, n_ = int(layout.seg_start[k]), int(layout.seg_len[k])
                want[at:at + n_] = marker(np.arange(s, s + n_))
                at += n_
            assert np.array_equal(out["inputs"][0], want[:-1]) and np.array_equal(
                out["targets"][0], want[1:])
        batch = next(iter(ld))  # and through a worker, from the cached layout
        assert batch["inputs"].shape == (4, L) and (batch["segment_ids"] >= 0).all()
    if SIZE.full_index:
        check_index_structure(big.a / "shard-00001.idx")
    record("scale", tokens=T0 + T1, documents=3 + N1, samples_per_epoch=n,
           epochs_permutation_checked=3, windows_read=sum(len(v) for v in addrs.values()),
           packed_rows_checked=len(rows), full_doc_index_written=SIZE.full_index)


def check_index_structure(path: Path) -> None:
    """The whole of shard 1's index, chunk by chunk: lengths, offsets, document index 0 … N."""
    from tokenmill.store import read_idx
    idx = read_idx(path)
    step, ptr = 1 << 24, 0
    for a in range(0, N1, step):
        lengths = np.asarray(idx.lengths[a:a + step], np.int64)
        want_ptr = ptr + 2 * np.concatenate([[0], np.cumsum(lengths[:-1])])
        assert np.array_equal(idx.pointers[a:a + step], want_ptr)
        assert np.array_equal(idx.doc_idx[a:a + len(lengths)], np.arange(a, a + len(lengths)))
        ptr = int(want_ptr[-1]) + 2 * int(lengths[-1])
    assert int(idx.doc_idx[N1]) == N1


def test_index_arithmetic_past_2_31_in_the_pure_functions():
    """The pure functions with more than 2^31 documents, rows and samples, on synthetic arrays."""
    rng = np.random.default_rng(5)
    for n in (2**31 + 3, 2**33 + 1, 2**40 - 7):
        perm = sampler.epoch_permutation(n, seed=1, epoch=2)
        i = np.unique(np.concatenate([rng.integers(0, n, 1 << 20), [0, n - 1, n - 2, 2**31, 2**32 % n]]))
        out = perm(i)
        assert out.min() >= 0 and out.max() < n and len(np.unique(out)) == len(i)  # no wrap
        assert out.max() > n // 2  # the upper half is reached
        # sample ids across an epoch boundary, positions past 2^32
        pos = np.arange(5 * n - 3, 5 * n + 3, dtype=np.int64)
        ids = sampler.sample_ids(pos, n=n, seed=1)
        assert np.array_equal(ids[:3], sampler.epoch_permutation(n, seed=1, epoch=4)(pos[:3] - 4 * n))
        assert np.array_equal(ids[3:], sampler.epoch_permutation(n, seed=1, epoch=5)(pos[3:] - 5 * n))
    sched = sampler.mixture_schedule([0.3, 0.7])
    pos = np.array([2**33 + 7, 2**40 + 3, 2**62 - 1], dtype=np.int64)
    store, draw = sampler.assign(sched, pos)
    for p, s, d in zip(pos.tolist(), store.tolist(), draw.tolist()):  # Python ints: no overflow
        cyc, r = divmod(p, sched.period)
        assert s == int(sched.store_of[r])
        assert d == cyc * sched.numerators[s] + int(sched.rank_in_period[r])
    first = sampler.batch_positions(2**33, batch_size=8, rank=3, world_size=4, start=2**40)
    assert first[0] == 2**40 + (2**33 * 4 + 3) * 8
    # a packed layout whose documents number past 2^31 and whose tokens start past 2^32
    seg_start = np.array([2**32 + 5, 2**33 + 9, 3 * 2**32], np.int64)
    layout = pack.PackedLayout(seq_len=8, row_ptr=np.array([0, 2, 3], np.int64),
                               seg_start=seg_start, seg_len=np.array([4, 5, 9], np.int64),
                               seg_doc=np.array([2**31 + 1, 2**31 + 2, 2**32], np.int64),
                               num_truncated=0, num_dropped_tokens=0)
    out = {k: np.zeros((2, 8), np.int64) for k in ("inputs", "targets", "segment_ids",
                                                   "positions", "loss_mask")}
    pack.fill_packed_rows(layout, np.array([1, 0]), lambda a, b: marker(np.arange(a, b)), out)
    row0 = np.concatenate([marker(np.arange(2**32 + 5, 2**32 + 9)),
                           marker(np.arange(2**33 + 9, 2**33 + 14))])
    assert np.array_equal(out["inputs"][1], row0[:-1]) and np.array_equal(out["targets"][1], row0[1:])
    assert np.array_equal(out["inputs"][0], marker(np.arange(3 * 2**32, 3 * 2**32 + 8)))
    assert out["segment_ids"][1].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    record("scale", permutation_sizes_checked="2^31+3, 2^33+1, 2^40-7")
