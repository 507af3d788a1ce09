"""Token-budget batches in the THD layout (issue 25): ``Loader(..., layout="packed",
seq_len=budget, thd=True)``. Real Loaders on a positional store (token = its place in the
stream, so every input names its document and offset): the ``cu_seqlens`` cover an epoch's
documents exactly once, equal a count made independently from ``segment_ids``, keep one shape,
resume exactly (also 2 → 3 ranks), whatever the workers; fp64 attention through them equals
each document's own attention."""

import json

import numpy as np
import pytest
from conftest import assert_resumes_exactly, same, take, write_positional_store
from test_cp_batches import attend

from tokenmill import Loader
from tokenmill.base.errors import ConfigError

BUDGET, CAP, DIM = 64, 6, 8
LENGTHS = np.minimum(3 * BUDGET, 1 + np.random.default_rng(11).lognormal(2.3, 1.1, 700)
                     .astype(np.int64))  # short documents, long ones, pieces of the longest
ENDS = np.cumsum(LENGTHS)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_positional_store(tmp_path_factory.mktemp("thd") / "s", LENGTHS,
                                  shard_tokens=5000)


def loader(store, *, batch_size=1, rank=0, world=1, **kw) -> Loader:
    kw = {"layout": "packed", "max_segments": CAP, "num_workers": 0, **kw}
    return Loader(store, seq_len=BUDGET, batch_size=batch_size, seed=3, rank=rank,
                  world_size=world, thd=True, **kw)


def sequences(batch: dict) -> list[tuple[int, int]]:
    """The non-empty [start, end) of every sequence ``cu_seqlens`` marks, in the flat batch."""
    cu = batch["cu_seqlens"].astype(np.int64)
    return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]


def pair_starts(batch: dict) -> list[np.ndarray]:
    """Each sequence's (input, target) pairs, checked to be one run of one document: the
    inputs of its first loss_mask-1 tokens, consecutive, their targets the next token."""
    flat = {k: batch[k].reshape(-1).astype(np.int64) for k in ("inputs", "targets", "loss_mask")}
    out = []
    for a, b in sequences(batch):
        mask = flat["loss_mask"][a:b]
        n = int(mask.sum())
        assert np.all(mask[:n] == 1), "a sequence's pairs are its first tokens"
        p = flat["inputs"][a:a + n]
        assert np.array_equal(flat["targets"][a:a + n], p + 1)
        assert np.all(np.diff(p) == 1) and len(set(np.searchsorted(ENDS, p, "right"))) <= 1
        assert n == 0 or np.searchsorted(ENDS, p[-1] + 1, "right") == \
            np.searchsorted(ENDS, p[0], "right"), "a pair across two documents"
        out.append(p)
    return out


def test_an_epoch_of_budgets_holds_every_pair_of_every_document_once(store):
    """Through cu_seqlens alone: every (input, target) pair of the corpus exactly once."""
    corpus = np.concatenate([np.arange(e - n, e - 1) for e, n in zip(ENDS, LENGTHS)])
    for kw in ({}, {"max_segments": None}):
        with loader(store, epochs=1, **kw) as ld:
            batches = take(ld)
            assert len(batches) == len(ld) == ld.samples_per_epoch
        got = np.concatenate([p for b in batches for p in pair_starts(b)])
        assert np.array_equal(np.sort(got), corpus), kw
        assert len(got) == len(corpus) == int(np.sum(LENGTHS - 1))


def independent_cu(segment_ids: np.ndarray, slots: int) -> list[int]:
    """cu_seqlens counted token by token: a sequence starts at each row's first token and where
    the segment changes to a document (padding, 0, joins the sequence before it)."""
    rows, length = segment_ids.shape
    cu = []
    for r in range(rows):
        for c in range(length):
            sid = int(segment_ids[r, c])
            if c == 0 or (sid != 0 and sid != int(segment_ids[r, c - 1])):
                cu.append(r * length + c)
    cu.append(rows * length)
    return cu + [rows * length] * (slots - len(cu))


CASES = {"packed budget": {}, "packed rows": {"batch_size": 3},
         "packed uncapped": {"batch_size": 2, "max_segments": None},
         "concat masks": {"batch_size": 2, "layout": "concat", "document_masks": True,
                          "max_segments": None}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cu_seqlens_equal_a_count_from_segment_ids_and_keep_one_shape(store, case):
    kw = CASES[case]
    b = kw.get("batch_size", 1)
    slots = b * (kw.get("max_segments", CAP) or BUDGET) + 1
    with loader(store, epochs=1, **kw) as ld:
        batches = take(ld)
    shapes = {k: (a.shape, a.dtype) for k, a in batches[0].items()}
    assert shapes["cu_seqlens"] == ((slots,), np.dtype(np.int32))
    assert shapes["max_seqlen"] == ((), np.dtype(np.int32))
    for i, batch in enumerate(batches):
        assert {k: (a.shape, a.dtype) for k, a in batch.items()} == shapes, f"batch {i}"
        want = independent_cu(batch["segment_ids"], slots)
        assert batch["cu_seqlens"].tolist() == want, f"batch {i}"
        assert int(batch["max_seqlen"]) == max(np.diff(want)), f"batch {i}"
    assert sum(len(sequences(x)) for x in batches) > 2 * len(batches)  # many documents a budget


def test_the_batches_are_the_same_for_any_workers(store):
    """cu_seqlens are made from the filled segment_ids wherever the rows were filled."""
    with loader(store) as ld:
        want = take(ld, 25)
    for kw in ({"num_workers": 2}, {"num_workers": 2, "worker_type": "process"},
               {"num_workers": "auto"}):
        with loader(store, **kw) as ld:
            assert same(take(ld, 25), want), kw


def test_thd_is_a_form_of_the_packed_rows_and_their_state(store):
    """The same rows as without thd, the same state: a checkpoint moves either way."""
    with loader(store, batch_size=2) as ld, Loader(store, seq_len=BUDGET, batch_size=2, seed=3,
                                                   layout="packed", max_segments=CAP,
                                                   num_workers=0) as plain:
        for got, rows in zip(take(ld, 10), take(plain, 10)):
            assert same([{k: got[k] for k in rows}], [rows])
        assert ld.fingerprint == plain.fingerprint
        ld.load_state_dict(plain.state_dict())
        plain.load_state_dict(ld.state_dict())


def test_resumes_exactly_at_every_step(store):
    assert_resumes_exactly(lambda: loader(store, batch_size=2, rank=1, world=2), 8)


def test_elastic_resume_2_to_3_ranks(store):
    """5 steps on 2 ranks, then 3 ranks from that sample: each rank's batches (rows and
    cu_seqlens) are those of a 3-rank run started there, and together the plan's global
    batches."""
    state = None
    for r in range(2):
        with loader(store, batch_size=2, rank=r, world=2) as ld:
            take(ld, 5)
            state = json.loads(json.dumps(ld.state_dict()))
    at = state["consumed_samples"]
    assert at == 5 * 4
    after = []
    for r in range(3):
        with loader(store, batch_size=2, rank=r, world=3) as ld:
            ld.load_state_dict(state)
            after.append(take(ld, 4))
            assert same(after[-1], [ld.batch_at(at + k * 6) for k in range(4)])
    with loader(store, batch_size=6) as whole:
        whole.load_state_dict({**whole.state_dict(), "consumed_samples": at})
        for k, batch in enumerate(take(whole, 4)):
            mine = np.concatenate([after[r][k]["inputs"] for r in range(3)])
            assert np.array_equal(mine, batch["inputs"])


def varlen_attention(batch: dict, q, k, v) -> np.ndarray:
    """What flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
    causal=True) computes, in fp64: each sequence causal on its own; empty ones skipped."""
    out = np.full(q.shape, np.nan)
    longest = int(batch["max_seqlen"])
    for a, b in sequences(batch):
        assert b - a <= longest
        out[a:b] = attend(q[a:b], k[a:b], v[a:b], np.tri(b - a, dtype=bool))
    return out


def documents(batch: dict) -> list[np.ndarray]:
    """Flat places of each run of one document in each row, found from the tokens alone (a
    positional store: consecutive values of one document), padding (segment 0) left out."""
    rows, length = batch["inputs"].shape
    runs = []
    for r in range(rows):
        tok = batch["inputs"][r].astype(np.int64)
        real = np.flatnonzero(batch["segment_ids"][r] != 0)
        doc = np.searchsorted(ENDS, tok[real], "right")
        cut = np.flatnonzero((np.diff(tok[real]) != 1) | (np.diff(doc) != 0)) + 1
        runs += [r * length + run for run in np.split(real, cut)]
    return runs


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp64_attention_through_cu_seqlens_equals_each_document_alone(store, case):
    rng = np.random.default_rng(5)
    with loader(store, **CASES[case]) as ld:
        batches = take(ld, 12)
    for batch in batches:
        n = batch["inputs"].size
        q, k, v = (rng.standard_normal((n, DIM)) for _ in range(3))
        got = varlen_attention(batch, q, k, v)
        for run in documents(batch):
            alone = attend(q[run], k[run], v[run], np.tri(len(run), dtype=bool))
            assert np.max(np.abs(got[run] - alone)) <= 1e-12


def test_misuse_is_refused_in_one_line(store):
    with pytest.raises(ConfigError, match="thd=True needs the documents of each row: "
                                          "layout='packed'.*got layout='concat'"):
        Loader(store, seq_len=BUDGET, batch_size=1, thd=True)
    with pytest.raises(ConfigError, match="thd must be True or False"):
        Loader(store, seq_len=BUDGET, batch_size=1, layout="packed", thd="yes")
    with pytest.raises(ConfigError, match="thd=True needs one batch shape.*seq_len_schedule"):
        Loader(store, seq_len_schedule=[(0, 16), (3, 32)], tokens_per_step=64,
               document_masks=True, thd=True)


def test_torch_batches_and_a_token_dataset_carry_the_varlen_arguments(store):
    """to_torch hands them out as tensors; a TokenDataset's copies in DataLoader workers are
    built with thd=True too (its spec carries it): the same batches as the Loader's."""
    import torch
    from tokenmill.torch import TokenDataset, to_torch
    with loader(store, batch_size=2) as ld:
        want = take(ld, 4)
    with loader(store, batch_size=2) as ld:
        assert same(take(to_torch(ld), 4), want)
    with loader(store, batch_size=2) as ld:
        got = torch.utils.data.DataLoader(TokenDataset(ld), batch_size=None, num_workers=2)
        assert same(take(got, 4), want)


def test_to_jax_refuses_thd_in_one_line(store):
    """cu_seqlens index one process's rows: no global (batch, seq_len) array of them."""
    from tokenmill.integrations.jax import to_jax
    with loader(store) as ld, pytest.raises(ConfigError, match="to_jax makes global .* drop "
                                                               "thd=True"):
        to_jax(ld, None)


def test_balanced_microbatches_each_have_their_own_cu_seqlens(store):
    """balance + microbatches=m, one budget a microbatch: cu_seqlens (m, CAP + 1) and
    max_seqlen (m,), row i counted independently from microbatch i's segment_ids, and fp64
    attention through row i equals each of its documents alone; resume stays exact."""
    m = 4
    make = lambda: loader(store, batch_size=m, world=2, rank=1, balance="attention",  # noqa: E731
                          microbatches=m)
    rng = np.random.default_rng(8)
    with make() as ld:
        batches = take(ld, 10)
    for batch in batches:
        assert batch["cu_seqlens"].shape == (m, CAP + 1) and batch["max_seqlen"].shape == (m,)
        for i in range(m):
            micro = {k: batch[k][i:i + 1] for k in ("inputs", "segment_ids")}
            micro |= {"cu_seqlens": batch["cu_seqlens"][i], "max_seqlen": batch["max_seqlen"][i]}
            want = independent_cu(micro["segment_ids"], CAP + 1)
            assert batch["cu_seqlens"][i].tolist() == want
            assert int(batch["max_seqlen"][i]) == max(np.diff(want))
            q, k, v = (rng.standard_normal((BUDGET, DIM)) for _ in range(3))
            got = varlen_attention(micro, q, k, v)
            for run in documents(micro):
                alone = attend(q[run], k[run], v[run], np.tri(len(run), dtype=bool))
                assert np.max(np.abs(got[run] - alone)) <= 1e-12
    assert_resumes_exactly(make, 5)
