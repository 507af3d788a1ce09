"""plan: the pure batch plan — rank slices, batch k as a function, the spec workers rebuild from,
and the proof that a store is still the one that was opened."""

import os
import pickle

import numpy as np
import pytest

from conftest import lengths_summing_to, same, write_positional_store
from tokenmill.load import pack, sampler
from tokenmill.base.errors import StoreError
from tokenmill.load.loader import Loader
from tokenmill.load.plan import (BatchPlan, LayoutConfig, batch_at, check_identity,
                                 global_positions, identity_of, plan_from_spec)
from tokenmill.load.rows import SLICE_SEGMENTS, one_piece_starts
from tokenmill.store import TokenStore

L = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(1)
    return write_positional_store(tmp_path_factory.mktemp("p") / "store",
                                  rng.integers(1, 40, size=150), shard_tokens=700)


@pytest.mark.parametrize("consumed,B,W", [(0, 1, 1), (5, 2, 3), (96, 4, 8), (2**40 + 3, 3, 2)])
def test_ranks_tile_the_global_batch_in_rank_order(consumed, B, W):
    slices = [global_positions(consumed, batch_size=B, rank=r, world_size=W) for r in range(W)]
    assert np.concatenate(slices).tolist() == list(range(consumed, consumed + B * W))
    for r, s in enumerate(slices):  # the sampler's rank slice, the one implementation
        assert np.array_equal(s, sampler.batch_positions(0, batch_size=B, rank=r, world_size=W,
                                                         start=consumed))


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_batch_k_is_a_pure_function_and_workers_rebuild_the_same_plan(store, layout):
    config = LayoutConfig(seq_len=L, layout=layout, seed=3)
    a = BatchPlan.open(store, config)
    b = BatchPlan.open(str(store), config)
    rebuilt = plan_from_spec(pickle.loads(pickle.dumps(a.spec())))  # as a worker process does
    rng = np.random.default_rng(0)
    with Loader(store, seq_len=L, batch_size=4, layout=layout, seed=3, rank=1, world_size=2,
                num_workers=0) as ld:
        for consumed in [0, 8, *rng.integers(0, 10 * a.samples_per_epoch, size=20).tolist()]:
            want = ld.batch_at(consumed)
            for plan in (a, b, rebuilt):
                got = batch_at(plan, consumed, batch_size=4, rank=1, world_size=2)
                assert same([got], [want]), consumed
    assert a.fingerprint == b.fingerprint == rebuilt.fingerprint == ld.fingerprint
    for plan in (a, b, rebuilt):
        plan.close()


def test_close_closes_only_the_stores_the_plan_opened(store):
    mine = TokenStore(store)
    plan = BatchPlan.open({mine: 0.5, str(store): 0.5}, LayoutConfig(seq_len=L))
    batch_at(plan, 0, batch_size=2)
    plan.close()
    plan.close()  # idempotent
    assert len(mine.shard(0))  # the caller's store stays open
    with pytest.raises(StoreError, match="closed"):
        plan.sources[1].store.shard(1)


def test_identity_survives_a_rewrite_of_the_same_store_but_not_another(tmp_path):
    path = write_positional_store(tmp_path / "s", [30] * 20, shard_tokens=200)
    store = TokenStore(path)
    want = identity_of(store)
    manifest = (path / "manifest.json").read_bytes()
    os.replace(path / "manifest.json", tmp_path / "old")
    (path / "manifest.json").write_bytes(manifest)  # a new inode, the same tokens
    again = check_identity(store, want)
    assert again.manifest != want.manifest and again.fingerprint == want.fingerprint
    write_positional_store(path, [30] * 20, shard_tokens=200, offset=7)  # other tokens
    with pytest.raises(StoreError, match="re-prepared or replaced"):
        check_identity(store, again)
    (path / "manifest.json").unlink()
    with pytest.raises(StoreError, match="manifest.json.*re-prepared or replaced"):
        check_identity(store, again)
    reopened = write_positional_store(tmp_path / "t", [30] * 20, shard_tokens=200, offset=7)
    with pytest.raises(StoreError, match="fingerprint"):
        check_identity(TokenStore(reopened), want)  # what a worker meets: another store


@pytest.mark.parametrize("segments", [3, 40])  # slice copies, then one index array per shard
def test_gather_is_the_ranges_back_to_back_across_shards(tmp_path, segments):
    lengths = np.full(200, 50)
    path = write_positional_store(tmp_path / "s", lengths, shard_tokens=2_000)  # 5 shards
    plan = BatchPlan.open(path, LayoutConfig(seq_len=64, layout="packed"))
    src, rng = plan.sources[0], np.random.default_rng(segments)
    docs = rng.integers(0, 200, segments)
    starts = docs * 50 + rng.integers(0, 20, segments)
    lens = rng.integers(1, 30, segments)
    got = src.rows.gather(starts.astype(np.int64), lens.astype(np.int64))
    want = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    assert src.store.num_shards == 5 and got.tolist() == want.tolist()
    plan.close()


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_packed_rows_by_slices_equal_the_index_gather_path(tmp_path, dtype):
    # documents of 1..150 tokens in shards of 700: rows of one, many or cut segments, padding;
    # every row through both paths, three at a time, into rows 0, 2, 3 of a batch of 4
    lengths = lengths_summing_to(30_000, docs=300, longest=150, seed=5)
    path = write_positional_store(tmp_path / "s", lengths, shard_tokens=700)
    plan = BatchPlan.open(path, LayoutConfig(seq_len=64, layout="packed"), dtype=dtype)
    src = plan.sources[0]
    layout = src.packed.window_rows(0, 0).layout  # a window's rows: the whole store here
    n, compared = layout.num_rows, 0
    for first in range(0, n - 3, 3):
        addrs, rows = np.arange(first, first + 3)[::-1].copy(), np.array([0, 2, 3])
        got, want = plan.new_buffers(4), plan.new_buffers(4)
        for a, b in zip(got.values(), want.values()):
            a.fill(7)
            b.fill(7)
        sliced = src.rows.packed(layout, addrs, rows, got)
        compared += sliced
        n_segs = int(layout.row_ptr[addrs + 1].sum() - layout.row_ptr[addrs].sum())
        assert sliced == (n_segs <= SLICE_SEGMENTS)  # more: left to the index gather
        if not sliced:
            continue
        pack.fill_packed_rows(layout, addrs, src.store.tokens, want, rows)
        for k in want:
            assert np.array_equal(got[k], want[k]), (first, k)
    assert compared > 50 and layout.most_segments > 1 and layout.padding_fraction > 0
    plan.close()


def test_asking_the_kernel_for_pages_first_changes_no_byte(tmp_path):
    # after a slow batch (pages read from disk) windows madvise(WILLNEED) their pages first
    path = write_positional_store(tmp_path / "s", np.full(300, 50), shard_tokens=2_000)
    a = BatchPlan.open(path, LayoutConfig(seq_len=64))
    b = BatchPlan.open(path, LayoutConfig(seq_len=64))
    b.sources[0].rows.advising = 10**6
    for consumed in range(0, 400, 8):
        assert same([batch_at(a, consumed, batch_size=8)], [batch_at(b, consumed, batch_size=8)])
    assert 0 < b.sources[0].rows.advising < 10**6  # it advised (a slow first map re-arms it)
    b.sources[0].rows.will_need(5_990, 64)  # across a shard's end: clamped to the shard
    a.close()
    b.close()


def test_windows_read_the_right_shard_whatever_the_previous_row_read(tmp_path):
    # a row reuses the previous row's shard only when it lies inside it: rows that cross an end,
    # go back a shard, stay, skip ahead, start at 0 and end at the last token, in one batch
    path = write_positional_store(tmp_path / "s", np.full(100, 50), shard_tokens=1_000)
    plan = BatchPlan.open(path, LayoutConfig(seq_len=64))
    rows = plan.sources[0].rows
    starts = [990, 1_010, 900, 1_500, 0, 4_935, 2_000 - 65, 2_000 - 64, 1_999, 3_100]
    out = plan.new_buffers(len(starts))
    rows.windows(starts, slice(0, len(starts)), out)
    for i, s in enumerate(starts):
        assert out["inputs"][i].tolist() == list(range(s, s + 64)), s
        assert out["targets"][i].tolist() == list(range(s + 1, s + 65)), s
    plan.close()


def test_one_piece_starts_mark_exactly_the_rows_of_one_whole_piece(tmp_path):
    lengths = lengths_summing_to(20_000, docs=200, longest=150, seed=2)
    layout = pack.pack_documents(lengths, seq_len=64)
    ids = np.arange(layout.num_rows)
    got = one_piece_starts(layout, ids)
    for r, s in zip(ids.tolist(), got):
        a, b = layout.row_ptr[r], layout.row_ptr[r + 1]
        whole = b - a == 1 and layout.seg_len[a] == 65
        assert s == (int(layout.seg_start[a]) if whole else -1)
    assert 0 < got.count(-1) < len(got)
