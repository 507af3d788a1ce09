"""Sample layouts: concat windows stay inside the stream; packed rows hold every pair exactly once."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.base.errors import ConfigError
from tokenmill.load.pack import (
    concat_num_samples,
    concat_offset,
    concat_starts,
    fill_packed_rows,
    pack_documents,
)

# ---- concat -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 2, 3, 7, 64, 2048])
def test_every_concat_offset_keeps_every_window_inside_the_stream(seq_len):
    for num_tokens in range(2 * seq_len, 2 * seq_len + 3 * seq_len + 5):
        n = concat_num_samples(num_tokens, seq_len)
        offsets = np.arange(seq_len)  # all offsets, not only the hashed ones
        last = concat_starts(np.array([n - 1]), seq_len=seq_len, offset=offsets)
        assert np.all(last + seq_len + 1 <= num_tokens)  # = offset + n·seq_len + 1
        assert seq_len - 1 + (n + 1) * seq_len + 1 > num_tokens  # n is the most that always fits


def test_concat_offsets_are_in_range_and_move_with_the_epoch():
    for seq_len in (1, 5, 2048):
        offsets = [concat_offset(seq_len, seed=3, epoch=e) for e in range(50)]
        assert all(0 <= o < seq_len for o in offsets)
        if seq_len > 1:
            assert len(set(offsets)) > 1
    assert concat_offset(2048, seed=0, epoch=0) != concat_offset(2048, seed=1, epoch=0)
    # a hash of (seed, epoch) alone, the same in every process and release: a saved concat run
    # resumes on these windows (change the values only if you mean to break users' resumes)
    assert [concat_offset(2048, seed=3, epoch=e) for e in range(6)] == [1512, 1504, 1639, 294,
                                                                         1668, 53]


def test_concat_windows_overlap_by_one_token():
    starts = concat_starts(np.array([0, 1, 2]), seq_len=4, offset=3)
    assert starts.tolist() == [3, 7, 11] and starts.dtype == np.int64


def test_too_few_tokens_says_how_many_are_needed():
    with pytest.raises(ConfigError, match="4,096"):
        concat_num_samples(4095, 2048)
    assert concat_num_samples(4096, 2048) == 1
    with pytest.raises(ConfigError, match="seq_len"):
        concat_num_samples(100, 0)


# ---- packed: helpers --------------------------------------------------------------------------


def naive_items(lengths, seq_len):
    """(length, doc, piece, offset) of every item, straight from the definition."""
    cap = seq_len + 1
    items = []
    for d, n in enumerate(lengths):
        if n <= cap:
            if n > 0:
                items.append((n, d, 0, 0))
            continue
        start, piece = 0, 0
        while start < n:
            length = min(cap, n - start)
            if length > 1:
                items.append((length, d, piece, start))
            start, piece = start + seq_len, piece + 1
    return items


def naive_bfd(lengths, seq_len):
    """Best-fit decreasing the slow obvious way: rows = [[room, [items…]], …]."""
    cap = seq_len + 1
    rows = []
    for item in sorted(naive_items(lengths, seq_len), key=lambda t: (-t[0], t[1], t[2])):
        fits = [r for r in range(len(rows)) if rows[r][0] >= item[0]]
        if fits:
            r = min(fits, key=lambda r: (rows[r][0], r))
        else:
            rows.append([cap, []])
            r = len(rows) - 1
        rows[r][0] -= item[0]
        rows[r][1].append(item)
    return rows


def fill_all(layout, tokens, rows=None):
    """Every row of the layout as a batch dict."""
    rows = np.arange(layout.num_rows) if rows is None else rows
    shape = (len(rows), layout.seq_len)
    out = {"inputs": np.full(shape, -1, np.int64), "targets": np.full(shape, -1, np.int64),
           "segment_ids": np.full(shape, -1, np.int32), "positions": np.full(shape, -1, np.int32),
           "loss_mask": np.full(shape, 7, np.uint8)}
    fill_packed_rows(layout, rows, tokens, out)
    return out


def random_lengths(rng, n, seq_len):
    cap = seq_len + 1
    special = [1, 2, cap - 1, cap, cap + 1, 2 * seq_len + 1, 3 * seq_len + 2]
    return np.concatenate([rng.integers(1, 3 * cap, n), special]).astype(np.int64)


# ---- packed: properties -----------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,seed", [(1, 0), (2, 1), (8, 2), (31, 3), (64, 4)])
def test_every_pair_appears_exactly_once(seq_len, seed):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, 300, seq_len)
    tokens = np.arange(int(lengths.sum()), dtype=np.int64)  # token = its global position
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    layout = pack_documents(lengths, seq_len)
    out = fill_all(layout, tokens)

    m = out["loss_mask"].astype(bool)
    assert set(np.unique(out["loss_mask"]).tolist()) <= {0, 1}
    inputs, targets = out["inputs"][m], out["targets"][m]
    assert np.array_equal(targets, inputs + 1)  # the pair is (t, t + 1) …
    assert np.array_equal(doc_of[inputs], doc_of[targets])  # … within one document
    # every in-document pair (t, t + 1) exactly once
    want = np.flatnonzero(doc_of[:-1] == doc_of[1:])
    assert np.array_equal(np.sort(inputs), want)


@pytest.mark.parametrize("seq_len", [1, 4, 16])
def test_segments_positions_and_mask_describe_the_documents(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = random_lengths(rng, 200, seq_len)
    tokens = np.arange(int(lengths.sum()), dtype=np.int64)
    layout = pack_documents(lengths, seq_len)
    out = fill_all(layout, tokens)
    seg, pos = out["segment_ids"], out["positions"]
    for r in range(layout.num_rows):
        lo, hi = layout.row_ptr[r], layout.row_ptr[r + 1]
        row_tokens = np.concatenate([np.arange(s, s + n) for s, n in
                                     zip(layout.seg_start[lo:hi], layout.seg_len[lo:hi])])
        used = len(row_tokens)
        assert used <= layout.capacity
        full = np.zeros(layout.capacity, np.int64)
        full[:used] = row_tokens
        assert np.array_equal(out["inputs"][r], full[:-1])
        assert np.array_equal(out["targets"][r], full[1:])
        ids = np.repeat(np.arange(1, hi - lo + 1), layout.seg_len[lo:hi])
        within = np.concatenate([np.arange(n) for n in layout.seg_len[lo:hi]])
        assert np.array_equal(seg[r, :min(used, seq_len)], ids[:seq_len])
        assert np.all(seg[r, used:] == 0)
        assert np.array_equal(pos[r, :min(used, seq_len)], within[:seq_len])
        assert np.all(pos[r, used:] == 0)
        # positions count tokens of the segment's own document: input = segment start + position
        starts = layout.seg_start[lo:hi][ids[:seq_len] - 1]
        assert np.array_equal(out["inputs"][r, :min(used, seq_len)], (starts + within[:seq_len]))
        mask = np.zeros(seq_len, bool)
        same = ids[:-1] == ids[1:]
        mask[:len(same)] = same[:seq_len]
        assert np.array_equal(out["loss_mask"][r].astype(bool), mask)


def test_short_documents_sit_whole_in_one_row_and_long_ones_are_cut():
    seq_len = 16
    lengths = random_lengths(np.random.default_rng(5), 500, seq_len)
    layout = pack_documents(lengths, seq_len)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    count = np.bincount(layout.seg_doc, minlength=len(lengths))
    short = lengths <= layout.capacity
    assert np.all(count[short] == 1)
    for d in np.flatnonzero(short):
        (k,) = np.flatnonzero(layout.seg_doc == d)
        assert layout.seg_len[k] == lengths[d] and layout.seg_start[k] == starts[d]
    assert np.all(count[~short] >= 2)
    assert layout.num_truncated == int(np.count_nonzero(~short))


def test_hand_example_rows_padding_and_counts():
    # seq_len 4, rows of 5: doc 0 fills a row; doc 3 (6) → pieces 5 + 2; doc 5 (9) → 5 + 5, and
    # its one-token tail is dropped; BFD then puts 3 + 2 in one row and 2 + 1 in the next
    layout = pack_documents(np.array([5, 3, 2, 6, 1, 9]), seq_len=4)
    assert layout.row_ptr.tolist() == [0, 1, 2, 3, 4, 6, 8]
    assert layout.seg_doc.tolist() == [0, 3, 5, 5, 1, 2, 3, 4]
    assert layout.seg_len.tolist() == [5, 5, 5, 5, 3, 2, 2, 1]
    assert layout.seg_start.tolist() == [0, 10, 17, 21, 5, 8, 14, 16]
    assert layout.num_rows == 6
    assert layout.padding_fraction == pytest.approx(1 - 28 / 30, abs=1e-15)
    assert layout.num_truncated == 2 and layout.num_dropped_tokens == 1


def test_hand_example_batch_arrays():
    layout = pack_documents(np.array([3, 2, 4]), seq_len=4)  # rows: [doc 2], [doc 0, doc 1]
    out = fill_all(layout, np.arange(100, 109))
    assert out["inputs"].tolist() == [[105, 106, 107, 108], [100, 101, 102, 103]]
    assert out["targets"].tolist() == [[106, 107, 108, 0], [101, 102, 103, 104]]
    assert out["segment_ids"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 2]]
    assert out["positions"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]


def test_empty_and_zero_length_documents():
    layout = pack_documents(np.array([], dtype=np.int64), seq_len=8)
    assert layout.num_rows == 0 and layout.padding_fraction == 0.0
    layout = pack_documents(np.array([0, 3, 0]), seq_len=8)
    assert layout.seg_doc.tolist() == [1] and layout.seg_start.tolist() == [0]


@pytest.mark.parametrize("lengths,seq_len", [(np.array([1, -2]), 4), (np.array([1.5]), 4),
                                             (np.array([3]), 0)])
def test_bad_input_is_a_config_error(lengths, seq_len):
    with pytest.raises(ConfigError, match="got"):
        pack_documents(lengths, seq_len)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 40), max_size=40))
def test_best_fit_decreasing_matches_a_naive_reference(seq_len, lengths):
    layout = pack_documents(np.array(lengths, dtype=np.int64), seq_len)
    rows = naive_bfd(lengths, seq_len)
    assert layout.num_rows == len(rows)
    for r, (_, items) in enumerate(rows):
        lo, hi = layout.row_ptr[r], layout.row_ptr[r + 1]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int) if lengths else []
        assert [(int(n), int(d), int(s)) for n, d, s in
                zip(layout.seg_len[lo:hi], layout.seg_doc[lo:hi], layout.seg_start[lo:hi])] == \
            [(n, d, starts[d] + off) for n, d, _, off in items]


def test_read_callable_and_destination_rows_give_the_same_batch():
    lengths = random_lengths(np.random.default_rng(9), 100, 8)
    tokens = np.arange(int(lengths.sum()), dtype=np.int64) * 3 + 1
    layout = pack_documents(lengths, 8)
    pick = np.array([5, 0, 5, layout.num_rows - 1])
    by_array = fill_all(layout, tokens, pick)
    calls = []

    def read(start, stop):
        calls.append((start, stop))
        return tokens[start:stop]

    by_call = fill_all(layout, read, pick)
    for k in by_array:
        assert np.array_equal(by_array[k], by_call[k]), k
    assert len(calls) == int(sum(layout.row_ptr[r + 1] - layout.row_ptr[r] for r in pick))
    # rows= writes into chosen rows of a bigger batch, leaving the others alone
    shape = (6, 8)
    out = {"inputs": np.full(shape, -1), "targets": np.full(shape, -1)}
    fill_packed_rows(layout, pick, tokens, out, rows=np.array([5, 1, 2, 0]))
    assert np.array_equal(out["inputs"][[5, 1, 2, 0]], by_array["inputs"])
    assert np.all(out["inputs"][[3, 4]] == -1)
    with pytest.raises(ConfigError, match=str(layout.num_rows)):
        fill_packed_rows(layout, np.array([layout.num_rows]), tokens, out)


def test_fill_metadata_the_docstring_row():
    from tokenmill.load.segments import fill_metadata
    out = {k: np.full((2, 7), 9, np.int32) for k in ("segment_ids", "positions", "loss_mask")}
    # row 0: segments of 3 and 4 tokens then padding; row 1: one segment filling the row
    fill_metadata(out, slice(0, 2), (2, 8), np.array([0, 3, 8]), np.array([3, 4, 8]),
                  np.array([False, True, False]))
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2], [1] * 7]
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3], list(range(7))]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0], [1] * 7]
