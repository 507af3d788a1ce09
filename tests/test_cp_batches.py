"""Context-parallel shares of a Loader's real batches (``cpsplit.cp_batch``, issue 25): every CP
rank's queries against the keys/values gathered from all CP ranks give the unsplit causal
document-masked attention (fp64, ≤ 1e-9), by the varlen arguments and by the mask; the ranks'
attention work is equal within 5%; a resumed run's shares are the uninterrupted run's."""

import json

import numpy as np
import pytest
from conftest import take, write_positional_store

from tokenmill import Loader
from tokenmill.base.errors import ConfigError
from tokenmill.load.attention import document_mask
from tokenmill.load.balance import imbalance
from tokenmill.load.cpsplit import CPShapes, cp_batch, cp_shapes

L, B, DIM = 64, 3, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A positional store of documents from 1 to 3·L tokens (rows of one long document, rows
    of many short ones, pieces of documents longer than a row), over several shards."""
    rng = np.random.default_rng(7)
    lengths = np.minimum(3 * L, 1 + rng.lognormal(2.5, 1.2, 500).astype(int))
    return write_positional_store(tmp_path_factory.mktemp("cp") / "s", lengths,
                                  shard_tokens=4000)


SETUPS = {  # name → Loader settings, the max_segments a fixed-shape cp_batch is given
    "packed": ({"layout": "packed"}, L),
    "packed-capped": ({"layout": "packed", "max_segments": 4}, 4),
    "concat-masks": ({"document_masks": True}, L),
    "concat": ({}, 1),
}


def batches(store, kw: dict, steps: int, **more) -> list[dict]:
    with Loader(store, seq_len=L, batch_size=B, seed=1, num_workers=0, **kw, **more) as ld:
        return take(ld, steps)


def attend(q, k, v, allowed):
    """fp64 softmax attention with a boolean mask."""
    logits = np.where(allowed, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ v


def unsplit(batch, q, k, v):
    """The whole batch's causal document-masked attention, row by row, flattened (B·L, dim)."""
    seg = batch.get("segment_ids", np.ones((B, L), np.int32))
    mask = document_mask(seg)
    return np.concatenate([attend(q[r * L:(r + 1) * L], k[r * L:(r + 1) * L],
                                  v[r * L:(r + 1) * L], mask[r]) for r in range(B)])


def gathered(shares, x, rng):
    """What an all-gather of every CP rank's slots of ``x`` holds: each rank's tokens' rows,
    its padding slots garbage (never to be seen by a real token)."""
    parts = []
    for s in shares:
        part = 1e3 * rng.standard_normal((len(s.index), x.shape[1]))
        part[s.index >= 0] = x[s.index[s.index >= 0]]
        parts.append(part)
    return np.concatenate(parts)


def by_varlen(s, q, k_all, v_all):
    """FlashAttention varlen's result, chunk by chunk: causal aligned bottom-right."""
    out = np.empty((len(s.index), q.shape[1]))
    for i in range(len(s.cu_seqlens_q) - 1):
        qs = slice(int(s.cu_seqlens_q[i]), int(s.cu_seqlens_q[i + 1]))
        keys = s.kv_index[s.cu_seqlens_k[i]:s.cu_seqlens_k[i + 1]]
        nq, nk = qs.stop - qs.start, len(keys)
        if nq == 0:
            continue
        allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
        out[qs] = attend(q[qs], k_all[keys], v_all[keys], allowed)
    return out


def by_mask(s, q, k_all, v_all):
    """The mask form (FlexAttention's mask_mod) over every gathered slot."""
    allowed = (s.sequence_ids[:, None] == s.gathered_sequence_ids[None, :]) & \
        (s.gathered_index[None, :] <= s.index[:, None])
    return attend(q, k_all, v_all, allowed)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("fixed", [False, True])
def test_cp_attention_over_gathered_keys_equals_the_unsplit_attention_in_fp64(store, setup, cp,
                                                                               fixed):
    kw, cap = SETUPS[setup]
    rng = np.random.default_rng(cp)
    for batch in batches(store, kw, 4):
        q, k, v = (rng.standard_normal((B * L, DIM)) for _ in range(3))
        whole = unsplit(batch, q, k, v)
        shares = [cp_batch(batch, cp=cp, cp_rank=r, max_segments=cap if fixed else None)
                  for r in range(cp)]
        k_all, v_all = gathered(shares, k, rng), gathered(shares, v, rng)
        for s in shares:
            real = s.index >= 0
            mine = np.where(real[:, None], q[np.maximum(s.index, 0)], rng.standard_normal(DIM))
            for form in (by_varlen, by_mask):
                out = form(s, mine, k_all, v_all)
                assert np.isfinite(out).all()  # padding attends to padding: no NaN anywhere
                assert np.abs(out[real] - whole[s.index[real]]).max() <= 1e-9, form.__name__


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_cp_shares_hold_every_token_once_with_the_batch_values(store, setup):
    kw, cap = SETUPS[setup]
    for batch in batches(store, kw, 3):
        for cp in (1, 2, 4):
            shares = [cp_batch(batch, cp=cp, cp_rank=r) for r in range(cp)]
            c = len(shares[0].index)
            index = np.concatenate([s.index for s in shares])
            assert np.array_equal(np.sort(index[index >= 0]), np.arange(B * L))
            assert max((s.index >= 0).sum() for s in shares) == c  # the largest share: no pad
            for r, s in enumerate(shares):
                real = s.index >= 0
                assert np.array_equal(s.gathered_index, index)  # every rank: the same gather
                assert np.array_equal(s.gathered_sequence_ids[r * c:(r + 1) * c], s.sequence_ids)
                for key, a in batch.items():
                    assert s.arrays[key].shape == (c,) and s.arrays[key].dtype == a.dtype
                    assert np.array_equal(s.arrays[key][real], a.reshape(-1)[s.index[real]])
                    assert not s.arrays[key][~real].any()  # padding: 0 (loss_mask 0)
                assert s.cu_seqlens_q[-1] == c and s.cu_seqlens_k[-1] <= len(s.kv_index)


def flops(s) -> int:
    """(query, key) pairs the varlen kernel computes for a share, its padding included: a chunk
    of nq queries over nk keys, causal bottom-right, is nq·(nk − nq) + nq·(nq + 1)/2."""
    nq = np.diff(s.cu_seqlens_q).astype(np.int64)
    nk = np.diff(s.cu_seqlens_k).astype(np.int64)
    return int((nq * (nk - nq) + nq * (nq + 1) // 2).sum())


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_ranks_do_equal_attention_work_within_5_percent_on_real_batches(tmp_path, cp):
    """Documents of a few hundred to a few thousand tokens, packed into rows of 4,096: every
    step's per-CP-rank pairs within 5% of each other, fixed shapes or not."""
    lengths = np.random.default_rng(cp).integers(200, 6000, 300)
    s = write_positional_store(tmp_path / "s", lengths)
    with Loader(s, seq_len=4096, batch_size=2, layout="packed", max_segments=16, seed=0,
                num_workers=0) as ld:
        for batch in take(ld, 12):
            for cap in (None, 16):
                work = [flops(cp_batch(batch, cp=cp, cp_rank=r, max_segments=cap))
                        for r in range(cp)]
                assert imbalance(work) <= 1.05, work


def test_fixed_shapes_are_the_same_for_every_batch_and_rank(store):
    kw, cap = SETUPS["packed-capped"]
    want = cp_shapes(B, L, cp=2, max_segments=cap)
    for batch in batches(store, kw, 6):
        for r in range(2):
            s = cp_batch(batch, cp=2, cp_rank=r, max_segments=cap)
            assert CPShapes(len(s.index), len(s.cu_seqlens_q), len(s.kv_index)) == want
            assert len(s.gathered_index) == 2 * want.tokens


def shares_of(loaded: list[dict], cp: int) -> list[list]:
    """Every CP rank's share of each batch, as plain lists (comparable with ==)."""
    return [[[np.asarray(x).tolist() if not isinstance(x, dict) else
              {k: a.tolist() for k, a in x.items()} for x in cp_batch(b, cp=cp, cp_rank=r)]
             for r in range(cp)] for b in loaded]


@pytest.mark.parametrize("setup", ["packed", "concat-masks"])
def test_resume_with_cp_on_gives_the_same_shares_on_every_dp_and_cp_rank(store, setup):
    """2 data-parallel ranks (balanced) × 2 CP ranks; a state saved at step k (JSON) resumes
    in a fresh Loader with the uninterrupted run's shares, at every k."""
    kw, _ = SETUPS[setup]
    steps, cp = 5, 2

    def loader(rank):
        return Loader(store, seq_len=L, batch_size=B, seed=1, rank=rank, world_size=2,
                      num_workers=0, balance="attention", **kw)

    for rank in range(2):
        with loader(rank) as ld:
            ref = shares_of(take(ld, steps), cp)
        for k in range(steps + 1):
            with loader(rank) as a:
                take(a, k)
                state = json.loads(json.dumps(a.state_dict()))
            with loader(rank) as b:
                b.load_state_dict(state)
                assert shares_of(take(b, steps - k), cp) == ref[k:], (rank, k)


def test_cp_batch_refuses_what_is_not_a_loader_batch_or_a_rank():
    batch = {"inputs": np.zeros((2, 8), np.int32), "segment_ids": np.ones((2, 8), np.int32)}
    with pytest.raises(ConfigError, match=r"cp_rank must be an int in \[0, 1\] \(got cp_rank=2"):
        cp_batch(batch, cp=2, cp_rank=2)
    with pytest.raises(ConfigError, match=r"all of one shape .*inputs \(16,\)"):
        cp_batch({k: a.reshape(-1) for k, a in batch.items()}, cp=2, cp_rank=0)
    with pytest.raises(ConfigError, match="'inputs' and the other arrays"):
        cp_batch({"segment_ids": batch["segment_ids"]}, cp=2, cp_rank=0)
    many = {**batch, "segment_ids": np.tile(np.arange(1, 9, dtype=np.int32), (2, 1))}
    with pytest.raises(ConfigError, match="16 attention sequences, more than batch_size × "
                                          "max_segments = 2 × 4"):
        cp_batch(many, cp=2, cp_rank=0, max_segments=4)
