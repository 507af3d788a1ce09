"""Balanced global batches, context-parallel shards, token-budget microbatches and sequence-length
schedules (issue 25's pure core): exact properties on self-describing data, no clocks."""

import numpy as np
import pytest

from tokenmill.load import attention
from tokenmill.load.balance import (CostModel, balance_rows, full_row_bound, imbalance, rank_costs,
                                    row_costs, row_segments)
from tokenmill.load.cpsplit import causal_pairs, cp_pairs, cp_split, thd_varlen, token_budget
from tokenmill.base.errors import ConfigError
from tokenmill.load.seqlens import LengthSchedule


def packed_rows(rng, rows: int, capacity: int) -> np.ndarray:
    """(rows, capacity) segment ids: documents of lognormal lengths packed in order, cut at row
    ends as the packer cuts long documents; some rows end in padding."""
    seg = np.zeros((rows, capacity), np.int32)
    for r in range(rows):
        at, sid = 0, 1
        full = rng.random() < 0.8
        while at < capacity:
            n = int(min(capacity - at, max(1, rng.lognormal(np.log(capacity / 6), 1.2))))
            if not full and rng.random() < 0.2:
                break
            seg[r, at:at + n] = sid
            at, sid = at + n, sid + 1
    return seg


def random_batch(rng, rows: int, capacity: int):
    """(lengths, offsets) of a random packed global batch."""
    return row_segments(packed_rows(rng, rows, capacity))


# ---- cost and rows ----------------------------------------------------------------------------

def test_row_segments_read_runs_of_ids_and_skip_padding():
    lengths, offsets = row_segments([[1, 1, 2, 0, 0], [1, 2, 2, 2, 3], [0, 0, 0, 0, 0]])
    assert lengths.tolist() == [2, 1, 1, 3, 1] and offsets.tolist() == [0, 2, 5, 5]
    with pytest.raises(ConfigError, match="2-d integer"):
        row_segments([1, 2, 3])


def test_default_cost_counts_the_pairs_a_causal_document_mask_keeps():
    seg = packed_rows(np.random.default_rng(0), 6, 64)
    pairs = attention.document_mask(seg) & (seg != 0)[:, :, None]  # real queries only
    assert row_costs(*row_segments(seg)).tolist() == pairs.sum(axis=(1, 2)).tolist()
    assert CostModel(a=2, b=3).segment_costs([4]).tolist() == [2 * 16 + 3 * 4]
    assert CostModel.transformer(1024).b == 0.5 + 6 * 1024
    for bad in ({"a": -1}, {"b": float("nan")}, {"a": 0, "b": 0}, {"a": True}):
        with pytest.raises(ConfigError, match="CostModel"):
            CostModel(**bad)
    with pytest.raises(ConfigError, match="offsets must rise"):
        row_costs([1, 2], [0, 3])


# ---- balanced assignment ----------------------------------------------------------------------

@pytest.mark.parametrize("world,micro,per", [(1, 1, 5), (8, 1, 4), (8, 2, 2), (3, 4, 3),
                                             (16, 4, 8)])
def test_every_row_is_dealt_exactly_once_in_equal_counts(world, micro, per):
    rng = np.random.default_rng(world * 100 + micro)
    costs = row_costs(*random_batch(rng, world * micro * per, 256))
    a = balance_rows(costs, world=world, micro=micro)
    assert a.shape == (world, micro, per)
    assert sorted(a.ravel().tolist()) == list(range(len(costs)))
    # within a rank, microbatch 0 holds its dearest rows: microbatch m is alike across ranks
    ranked = costs[a.reshape(world, -1)]
    assert np.all(np.diff(ranked, axis=1) <= 0)


def test_the_deal_is_deterministic_and_ties_go_by_index():
    costs = row_costs(*random_batch(np.random.default_rng(1), 64, 512))
    first = balance_rows(costs, world=8, micro=2)
    assert np.array_equal(first, balance_rows(costs.copy(), world=8, micro=2))
    assert balance_rows(np.ones(6), world=3).tolist() == [[[0, 3]], [[1, 4]], [[2, 5]]]
    assert balance_rows([5.0, 1.0, 4.0, 2.0], world=2).tolist() == [[[0, 1]], [[2, 3]]]


def test_no_single_swap_lowers_the_heaviest_rank_and_the_floor_holds():
    capacity = 512
    for seed in range(20):
        lengths, offsets = random_batch(np.random.default_rng(seed), 32, capacity)
        costs = row_costs(lengths, offsets)
        a = balance_rows(costs, world=8)
        load = rank_costs(costs, a)
        hi = int(np.argmax(load))
        for x in a[hi].ravel():
            for lo in range(8):
                for y in a[lo].ravel():
                    d = costs[x] - costs[y]
                    if lo != hi and d > 0:
                        assert max(load[hi] - d, load[lo] + d) >= load[hi] * (1 - 1e-9)
        plan_order = imbalance(costs.reshape(8, 4).sum(axis=1))
        assert imbalance(load) <= plan_order + 1e-12
        assert full_row_bound(lengths, offsets, world=8, capacity=capacity) <= imbalance(load)


def test_a_batch_that_cannot_be_dealt_evenly_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match="10 rows cannot be dealt to world=4 × micro=1"):
        balance_rows(np.ones(10), world=4)
    with pytest.raises(ConfigError, match="world must be an int >= 1"):
        balance_rows(np.ones(4), world=0)


def test_full_row_bound_counts_rows_of_one_whole_row_segment():
    assert full_row_bound([4, 4, 4, 1, 1, 1, 1], [0, 1, 2, 3, 7], world=2, capacity=4) == 20 / 17
    assert full_row_bound([1, 1], [0, 1, 2], world=2, capacity=4) == 1.0


# ---- context parallelism ----------------------------------------------------------------------

def original_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Position in its document and 1-based segment id of every token of the unsplit stream."""
    sid = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else np.zeros(0, int)
    return pos, sid


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_cp_shards_hold_every_token_once_with_its_position_and_segment(cp):
    rng = np.random.default_rng(cp)
    lengths = np.concatenate([[1, 2 * cp - 1, 2 * cp, 0], rng.integers(1, 300, 40)])
    shards = cp_split(lengths, cp=cp)
    assert len(shards) == cp
    everything = np.concatenate([s.index for s in shards])
    assert np.array_equal(np.sort(everything), np.arange(lengths.sum()))
    pos, sid = original_positions(lengths)
    for s in shards:
        assert np.array_equal(s.positions, pos[s.index])
        assert np.array_equal(s.segment_ids, sid[s.index])
        q, k = np.diff(s.cu_seqlens_q), np.diff(s.cu_seqlens_k)
        assert s.cu_seqlens_q[-1] == len(s.index) and s.cu_seqlens_k[-1] == len(s.kv_index)
        assert np.all(q > 0) and np.all(k >= q)
        assert s.max_seqlen_q == q.max() and s.max_seqlen_k == k.max()
        # each key sequence is its chunk's document prefix, ending at the chunk's last query
        ends = s.cu_seqlens_k[1:] - 1
        assert np.array_equal(s.kv_index[ends], s.index[s.cu_seqlens_q[1:] - 1])
        assert np.all(pos[s.kv_index[s.cu_seqlens_k[:-1]]] == 0)


def attend(q, k, v, allowed):
    """fp64 softmax attention with a boolean mask."""
    logits = np.where(allowed, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ v


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_equals_the_unsplit_attention_in_fp64(cp):
    rng = np.random.default_rng(10 + cp)
    lengths = np.array([37, 1, 64, 5, 2 * cp, 90])
    total, dim = int(lengths.sum()), 16
    q, k, v = (rng.standard_normal((total, dim)) for _ in range(3))
    pos, sid = original_positions(lengths)
    whole = attend(q, k, v, (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None]))
    for s in cp_split(lengths, cp=cp):
        out = np.empty((len(s.index), dim))
        for i in range(len(s.cu_seqlens_q) - 1):  # varlen, causal aligned bottom-right
            qs = slice(s.cu_seqlens_q[i], s.cu_seqlens_q[i + 1])
            keys = s.kv_index[s.cu_seqlens_k[i]:s.cu_seqlens_k[i + 1]]
            nq, nk = qs.stop - qs.start, len(keys)
            allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
            out[qs] = attend(q[s.index[qs]], k[keys], v[keys], allowed)
        assert np.abs(out - whole[s.index]).max() <= 1e-9


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_cp_ranks_compute_equal_causal_pairs_on_lengths_divisible_by_2cp(cp):
    rng = np.random.default_rng(cp)
    lengths = rng.integers(0, 500, 50) * 2 * cp
    pairs = cp_pairs(lengths, cp=cp)
    assert len(set(pairs.tolist())) == 1
    assert pairs.sum() == causal_pairs(0, lengths).sum() == (lengths * (lengths + 1) // 2).sum()
    # a document alone, of any length: the ranks differ by less than its length (O(n) of n²/cp)
    for n in range(1, 400):
        p = cp_pairs([n], cp=cp)
        assert p.sum() == n * (n + 1) // 2 and p.max() - p.min() <= n


def test_cp_pairs_per_rank_are_within_5_percent_on_a_long_document_stream():
    lengths = np.random.default_rng(3).integers(2000, 9000, 64)
    for cp in (2, 4, 8):
        assert imbalance(cp_pairs(lengths, cp=cp)) <= 1.05


def test_cp_refuses_a_bad_cp_or_lengths():
    with pytest.raises(ConfigError, match="cp must be an int >= 1"):
        cp_split([4], cp=0)
    with pytest.raises(ConfigError, match="lengths must be a 1-d array of integers >= 0"):
        cp_split([4, -1], cp=2)


# ---- token-budget microbatches ----------------------------------------------------------------

@pytest.mark.parametrize("budget,cap", [(64, None), (64, 3), (1000, None), (7, 2)])
def test_token_budget_covers_every_token_once_in_order_within_budget(budget, cap):
    lengths = np.random.default_rng(budget).integers(0, 200, 300)
    mb = token_budget(lengths, budget=budget, max_segments=cap)
    assert mb.ptr[0] == 0 and mb.ptr[-1] == len(mb.doc) and np.all(np.diff(mb.ptr) > 0)
    for d in range(len(lengths)):  # each document's pieces tile it, in order
        mine = np.flatnonzero(mb.doc == d)
        assert mb.length[mine].sum() == lengths[d]
        assert np.array_equal(mb.offset[mine], np.cumsum(mb.length[mine]) - mb.length[mine])
    assert np.all(np.diff(mb.doc) >= 0) and np.all(mb.length > 0)
    tokens = np.add.reduceat(mb.length, mb.ptr[:-1])
    pieces = np.diff(mb.ptr)
    assert tokens.max() <= budget and (cap is None or pieces.max() <= cap)
    # greedy: the next microbatch's first piece did not fit in the one before
    nxt = mb.length[mb.ptr[1:-1]]
    assert np.all((tokens[:-1] + nxt > budget) | (pieces[:-1] == (cap or -1)))
    assert mb.cut == int(np.sum(lengths > budget))


def test_thd_varlen_pads_tokens_into_the_last_sequence_and_slots_with_the_last_offset():
    assert thd_varlen([3, 4]).tolist() == [0, 3, 7]
    assert thd_varlen([3, 4], budget=8, slots=5).tolist() == [0, 3, 8, 8, 8]
    assert thd_varlen([], budget=8, slots=3).tolist() == [0, 8, 8]
    with pytest.raises(ConfigError, match="2 sequences needs 3 cu_seqlens slots.*slots=2"):
        thd_varlen([3, 4], slots=2)
    with pytest.raises(ConfigError, match="7 tokens is over budget=6"):
        thd_varlen([3, 4], budget=6)


# ---- sequence-length schedules ----------------------------------------------------------------

def test_schedule_is_exact_at_every_phase_boundary_and_inverts():
    phases = ((0, 512), (7, 1024), (20, 4096))
    sched = LengthSchedule(phases, tokens_per_step=8192)
    samples = 0
    for step in range(40):
        shape = sched.at(step)
        assert shape.seq_len * shape.batch_size == 8192
        assert shape.first_sample == samples and shape.first_token == step * 8192
        assert sched.step_at_sample(samples) == step
        samples += shape.batch_size
    assert [sched.at(s)[:2] for s in (6, 7, 8, 19, 20, 21)] == [
        (512, 16), (1024, 8), (1024, 8), (1024, 8), (4096, 2), (4096, 2)]
    with pytest.raises(ConfigError, match="falls inside step 7"):
        sched.step_at_sample(7 * 16 + 3)


def test_schedule_refuses_phases_that_break_constant_tokens():
    with pytest.raises(ConfigError, match="seq_len=3000, which does not divide"):
        LengthSchedule(((0, 1024), (5, 3000)), tokens_per_step=8192)
    with pytest.raises(ConfigError, match="begin at step 0 and rise"):
        LengthSchedule(((0, 1024), (5, 2048), (5, 4096)), tokens_per_step=8192)
    with pytest.raises(ConfigError, match="begin at step 0"):
        LengthSchedule(((1, 1024),), tokens_per_step=8192)
    with pytest.raises(ConfigError, match="pairs"):
        LengthSchedule((), tokens_per_step=8192)
