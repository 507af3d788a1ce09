"""Grain integration: a store as a RandomAccessDataSource, read through Grain's own pipelines,
with two mp_prefetch worker processes and Grain's checkpoints."""

import pickle

import grain
import numpy as np
import pytest

from conftest import lengths_summing_to, run_guide, write_positional_store
from tokenmill.base.errors import ConfigError
from tokenmill.integrations.grain import TokenSource, source
from tokenmill.load.loader import Loader

L = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Token = global position: 60·L + L tokens, 60 concat windows, over 3 shards."""
    lengths = lengths_summing_to(61 * L, docs=25, longest=30, seed=11)
    return write_positional_store(tmp_path_factory.mktemp("g") / "store", lengths, shard_tokens=200)


def rows(records):
    """Records as sorted tuples of (inputs, targets, …): order-free comparison."""
    return sorted(tuple(tuple(r[k].tolist()) for k in sorted(r)) for r in records)


def test_concat_record_i_is_the_window_at_token_i_times_seq_len(store):
    src = source(store, seq_len=L)
    assert len(src) == 60
    for i in (0, 1, 37, 59, -1):
        r = src[i]
        start = (i % 60) * L
        assert r["inputs"].tolist() == list(range(start, start + L))
        assert r["targets"].tolist() == list(range(start + 1, start + L + 1))
        assert r["inputs"].dtype == np.int32
    with pytest.raises(IndexError):
        src[60]


def test_packed_records_are_the_rows_of_a_loader_epoch(store):
    src = source(store, seq_len=L, layout="packed")
    n = len(src)
    epoch = Loader(store, seq_len=L, batch_size=n, layout="packed").batch_at(0)  # every row once
    assert set(src[0]) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    want = [{k: v[j] for k, v in epoch.items()} for j in range(n)]
    assert rows([src[i] for i in range(n)]) == rows(want)


def test_grain_shuffle_batch_and_two_mp_prefetch_workers(store):
    def pipeline():
        return (grain.MapDataset.source(source(store, seq_len=L)).shuffle(seed=3).repeat(2)
                .batch(6).to_iter_dataset())

    inline = [b["inputs"] for b in pipeline()]
    assert len(inline) == 20 and inline[0].shape == (6, L)
    for epoch in (inline[:10], inline[10:]):  # each epoch: every window once, shuffled
        starts = np.concatenate(epoch)[:, 0]
        assert sorted(starts.tolist()) == [i * L for i in range(60)]
        assert starts.tolist() != sorted(starts.tolist())
    assert not np.array_equal(np.concatenate(inline[:10]), np.concatenate(inline[10:]))

    ds = pipeline().mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=2))
    it = iter(ds)
    first = [next(it)["inputs"] for _ in range(7)]
    state = it.get_state()  # Grain's own checkpoint, taken across its worker processes
    rest = [b["inputs"] for b in it]
    assert all(np.array_equal(a, b) for a, b in zip(first + rest, inline, strict=True))

    it = iter(ds)
    it.set_state(state)
    resumed = [b["inputs"] for b in it]
    assert all(np.array_equal(a, b) for a, b in zip(resumed, inline[7:], strict=True))


def test_source_pickles_by_path_and_repr_names_the_content(store):
    src = source(store, seq_len=L, layout="packed", dtype="int64")
    copy = pickle.loads(pickle.dumps(src))
    assert len(pickle.dumps(src)) < 1000  # the path and settings, not the memory map
    assert repr(copy) == repr(src) and src._sample_source.store.fingerprint in repr(src)
    assert rows([copy[i] for i in range(len(copy))]) == rows([src[i] for i in range(len(src))])
    assert copy[0]["inputs"].dtype == np.int64
    assert isinstance(src, grain.sources.RandomAccessDataSource)


def test_bad_settings_are_refused_with_the_value(store):
    with pytest.raises(ConfigError, match="dtype='int16'"):
        TokenSource(store, L, dtype="int16")
    with pytest.raises(ConfigError, match="layout='rows'"):
        source(store, L, layout="rows")
    with pytest.raises(ConfigError, match="seq_len"):
        source(store, 0)


# ---- the guide's example runs as written ---------------------------------------------------

def test_guide_example_runs(tmp_path):
    """docs/guide-grain.md's python blocks, in order, as one script in an empty directory."""
    done = run_guide("guide-grain.md", tmp_path)
    assert "(8, 256)" in done.stdout
