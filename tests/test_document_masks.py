"""Concat windows with document masks (``Loader(..., document_masks=True)``): the segment ids,
positions and loss mask of the documents each window crosses, checked token by token against the
document lengths on positional stores; plain concat unchanged; resume, workers, the cap."""

import json

import numpy as np
import pytest

from conftest import assert_resumes_exactly, same, take, write_positional_store
from tokenmill import Loader
from tokenmill.base.errors import ConfigError

L = 16
OFFSET_B = 10**8  # store b's tokens start here: a token names its store and position


def lengths_of(seed: int, docs: int) -> np.ndarray:
    """Short documents (1 … 29 tokens), some empty, a few longer than any window here."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=docs)
    lengths[rng.choice(docs, docs // 20, replace=False)] = 0
    lengths[::50] = 150
    return lengths


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two positional stores of small shards (windows cross shard ends): (path, lengths) each."""
    tmp = tmp_path_factory.mktemp("masks")
    a, b = lengths_of(1, 400), lengths_of(2, 250)
    return ((write_positional_store(tmp / "a", a, shard_tokens=700), a),
            (write_positional_store(tmp / "b", b, shard_tokens=500, offset=OFFSET_B), b))


def expected(lengths: np.ndarray, s: int, seq_len: int) -> tuple[list, list, list]:
    """segment_ids, positions, loss_mask of the window at global token ``s``, from the document
    lengths alone: a new segment (from 1) and position 0 wherever the document changes, and at
    the window's first token; loss 0 where input and target are in different documents."""
    doc = np.repeat(np.arange(len(lengths)), lengths)  # the document of every token
    seg, pos, mask = [], [], []
    for c in range(seq_len):
        p = s + c
        new = c == 0 or doc[p] != doc[p - 1]
        seg.append(1 if c == 0 else seg[-1] + new)
        pos.append(0 if new else pos[-1] + 1)
        mask.append(int(doc[p] == doc[p + 1]))
    return seg, pos, mask


def check_batch(batch: dict, stores) -> int:
    """Every row of ``batch`` against ``expected``; returns the most segments a row holds."""
    most = 0
    for r, row in enumerate(batch["inputs"].tolist()):
        (_, lengths), base = (stores[1], OFFSET_B) if row[0] >= OFFSET_B else (stores[0], 0)
        seg, pos, mask = expected(lengths, row[0] - base, len(row))
        assert batch["segment_ids"][r].tolist() == seg, (r, row[0])
        assert batch["positions"][r].tolist() == pos, (r, row[0])
        assert batch["loss_mask"][r].tolist() == mask, (r, row[0])
        most = max(most, seg[-1])
    return most


@pytest.mark.parametrize("seq_len", [5, 16, 64])
def test_every_window_of_two_epochs_carries_the_documents_it_crosses(stores, seq_len):
    (a, _), _ = stores
    with Loader(a, seq_len=seq_len, batch_size=4, document_masks=True, num_workers=0) as ld:
        assert ld.plan.new_buffers(4).keys() == {"inputs", "targets", "segment_ids",
                                                 "positions", "loss_mask"}
        most = max(check_batch(ld.batch_at(k), stores)
                   for k in range(0, 2 * ld.samples_per_epoch - 3, 4))
    assert most > 3 if seq_len > 5 else most >= 2  # windows really cross documents


def test_a_mixture_of_stores_carries_each_ones_documents(stores):
    (a, _), (b, _) = stores
    with Loader({a: 0.6, b: 0.4}, seq_len=L, batch_size=8, document_masks=True, seed=3,
                num_workers=0) as ld:
        firsts = []
        for batch in take(ld, 30):
            check_batch(batch, stores)
            firsts += batch["inputs"][:, 0].tolist()
    assert min(firsts) < OFFSET_B <= max(firsts)  # both stores drawn, rows interleaved


def test_plain_concat_is_unchanged(stores):
    (a, _), _ = stores
    kw = dict(seq_len=L, batch_size=4, num_workers=0)
    with Loader(a, **kw) as plain, Loader(a, document_masks=True, **kw) as masked:
        # the fingerprint of this store's plain concat stream before document masks existed
        assert plain.fingerprint == "1d0293fe41deb9de" != masked.fingerprint
        assert "document_masks" not in plain.state_dict()["stream"]
        assert masked.state_dict()["stream"]["document_masks"] is True
        for got, want in zip(take(masked, 20), take(plain, 20)):
            assert want.keys() == {"inputs", "targets"}
            assert same([{k: got[k] for k in want}], [want])  # the same windows, masks beside


def test_resumes_exactly_at_every_step_across_an_epoch(stores):
    (a, _), _ = stores
    with Loader(a, seq_len=64, batch_size=8, num_workers=0) as ld:
        steps = len(ld) + 3  # into the second epoch (its windows start elsewhere)
    assert_resumes_exactly(lambda: Loader(a, seq_len=64, batch_size=8, document_masks=True,
                                          num_workers=0), steps)


@pytest.mark.parametrize("workers,kind", [(1, "thread"), (3, "thread"), (2, "process"),
                                          ("auto", "thread")])
def test_identical_batches_for_any_worker_setting(stores, workers, kind):
    (a, _), (b, _) = stores

    def run(w, k):
        with Loader({a: 0.5, b: 0.5}, seq_len=L, batch_size=4, document_masks=True, seed=5,
                    num_workers=w, worker_type=k) as ld:
            return take(ld, 25)
    assert same(run(workers, kind), run(0, "thread"))


def test_max_segments_refuses_a_window_that_crosses_more_documents(tmp_path):
    lengths = np.concatenate([np.full(40, 40), np.ones(60, np.int64), np.full(40, 40)])
    path = write_positional_store(tmp_path / "s", lengths, shard_tokens=900)
    kw = dict(seq_len=L, batch_size=4, document_masks=True, num_workers=0)
    with Loader(path, max_segments=3, **kw) as capped:
        with pytest.raises(ConfigError, match=r"the concat window at global token [\d,]+ crosses "
                           r"(\d+) documents \([\d,]+ … [\d,]+\) in its 16 inputs, more than "
                           r"max_segments=3: raise max_segments"):
            for _ in range(capped.samples_per_epoch // 4):
                capped.batch_at(_ * 4)
    with Loader(path, **kw) as free, Loader(path, max_segments=L, **kw) as roomy:
        assert roomy.fingerprint == free.fingerprint  # the cap refuses, it changes no batch
        assert same(take(roomy, len(roomy)), take(free, len(free)))
    with Loader(path, max_segments=3, **kw) as ld:  # a run capped at 3, saved before the refusal
        state = json.loads(json.dumps(ld.state_dict()))
    with Loader(path, max_segments=L, **kw) as ld:  # resumes with the cap raised
        assert [d.safe for d in ld.resume_report(state)] == [True]
        ld.load_state_dict(state)
    with Loader(path, seq_len=L, batch_size=4, num_workers=0) as plain:
        with pytest.raises(ConfigError, match="document_masks True → False"):
            plain.load_state_dict(state)


def test_the_option_is_checked(stores):
    (a, _), _ = stores
    with pytest.raises(ConfigError, match=r"document_masks=True or False.*'yes'"):
        Loader(a, seq_len=L, batch_size=4, document_masks="yes")
    with pytest.raises(ConfigError, match="packed rows always carry segment_ids"):
        Loader(a, seq_len=L, batch_size=4, layout="packed", document_masks=True)
    with pytest.raises(ConfigError, match="max_segments needs layout='packed' or document_masks"):
        Loader(a, seq_len=L, batch_size=4, max_segments=4)


def test_a_token_dataset_keeps_the_document_masks(stores):
    pytest.importorskip("torch")
    from tokenmill.torch import TokenDataset
    (a, _), _ = stores
    with Loader(a, seq_len=L, batch_size=4, document_masks=True, num_workers=0) as ld:
        want = ld.batch_at(0)
        got = next(iter(TokenDataset(ld)))
        assert ld.fingerprint == TokenDataset(ld).state_dict()["fingerprint"]
    assert all(np.array_equal(got[k].numpy(), want[k]) for k in want)
