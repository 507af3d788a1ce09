"""Loader(balance=…, stratify=True): global batches of rows stratified by cost (issue 25). Real
Loaders on a positional store (token p is p: a row names its document and token range): every
row of an epoch once, exact and elastic resume, the benchmark's per-step figure, fingerprints."""

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import assert_resumes_exactly, run_ranks, take, write_positional_store

from tokenmill import Loader
from tokenmill.base.errors import ConfigError
from tokenmill.load import balanced as balanced_module
from tokenmill.load.balance import balance_rows, imbalance, row_costs, row_segments, \
    stratified_order

L = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Documents of 1 to 4·L tokens (rows of one long document and rows of many short ones)."""
    rng = np.random.default_rng(99)
    return write_positional_store(tmp_path_factory.mktemp("strat") / "s", np.minimum(
        4 * L, 1 + rng.lognormal(2.0, 1.0, 900).astype(int)), shard_tokens=2500)


LAYOUTS = {"packed": {"layout": "packed"}, "concat-masks": {"document_masks": True}}


def loader(store, *, rank=0, world=1, per=1, stratify=True, seed=3, layout="packed",
           num_workers=0, **more) -> Loader:
    return Loader(store, seq_len=L, batch_size=per, seed=seed, rank=rank, world_size=world,
                  num_workers=num_workers, balance="attention", stratify=stratify,
                  **LAYOUTS[layout], **more)


def parts(batch: dict) -> list[tuple[int, int]]:
    """(first token, inputs) of every document part of a batch's rows: its document and token
    range, since token p of the store is p."""
    seg = batch["segment_ids"]
    start = seg != 0
    start[:, 1:] &= seg[:, 1:] != seg[:, :-1]  # a part's first column (row_segments' rule)
    lengths = row_segments(seg)[0]
    first = batch["inputs"][start]
    return sorted(zip(first.tolist(), lengths.tolist()))


def rows(batch: dict) -> list[tuple]:
    """Every row of a batch as one hashable tuple of all its arrays' values."""
    keys = sorted(batch)
    return [tuple(np.concatenate([batch[k][i].astype(np.int64) for k in keys]).tolist())
            for i in range(len(batch["inputs"]))]


@pytest.mark.parametrize("layout,block", [("packed", 64), ("packed", balanced_module.STRATA_ROWS),
                                          ("concat-masks", 64)])
def test_every_row_of_each_epoch_once_by_document_and_token_range(store, layout, block,
                                                                   monkeypatch):
    monkeypatch.setattr(balanced_module, "STRATA_ROWS", block)  # 64: blocks, the last joined
    with loader(store, stratify=False, layout=layout) as plain, \
            loader(store, layout=layout, per=7) as strat:  # a step crosses each epoch end
        n = plain.samples_per_epoch
        assert n > 3 * 64 and n % 7  # several blocks of 64 rows an epoch
        want = take(plain, 2 * n)
        got = joined(take(strat, -(-2 * n // 7)))  # the stratified global batches
        for epoch in range(2):
            mine = {k: v[epoch * n:(epoch + 1) * n] for k, v in got.items()}
            digest = [xxhash.xxh3_64_hexdigest(json.dumps(parts(b)).encode()) for b in
                      (joined(want[epoch * n:(epoch + 1) * n]), mine)]
            assert digest[0] == digest[1], f"epoch {epoch}: (document, token range) differ"
            assert sorted(rows(mine)) == sorted(x for b in want[epoch * n:(epoch + 1) * n]
                                                for x in rows(b)), f"epoch {epoch}"
            assert rows(mine) != [x for b in want[epoch * n:(epoch + 1) * n] for x in rows(b)]


def joined(batches: list[dict]) -> dict:
    """Batches as one batch of all their rows, in order."""
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_each_global_batch_holds_a_spread_of_the_block_s_costs(store):
    """Any run of places dealt by ``stratified_order`` holds rows from every part of the cost
    range: 32 consecutive places of 4,096 rows of distinct costs miss no 1/16 of the ranks."""
    costs = np.random.default_rng(0).permutation(4096).astype(float)
    order = stratified_order(costs, 12345)
    assert sorted(order.tolist()) == list(range(4096))
    ranks = np.argsort(np.argsort(costs))[order]
    for start in (0, 1000, 4064):
        assert len(set(ranks[start:start + 32] * 16 // 4096)) == 16


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_workers_hand_out_the_same_stratified_batches(store, worker_type):
    with loader(store, rank=2, world=3, per=4) as ld:
        want = take(ld, 8)
    with loader(store, rank=2, world=3, per=4, num_workers=2, worker_type=worker_type) as ld:
        got = take(ld, 8)
    assert all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)


@pytest.mark.parametrize("micro", [1, 2])
def test_resumes_exactly_at_every_step(store, micro, monkeypatch):
    monkeypatch.setattr(balanced_module, "STRATA_ROWS", 8)  # 10 steps of 6 rows: 7 blocks
    assert_resumes_exactly(lambda: loader(store, rank=1, world=3, per=2, microbatches=micro), 10)


def test_elastic_resume_2_to_3_to_1_ranks_deals_the_stratified_global_batch(store):
    per_step, state = 12, None
    for world, steps in ((2, 4), (3, 5), (1, 3)):
        per = per_step // world
        got, start, state = run_ranks(
            lambda r: loader(store, rank=r, world=world, per=per), world, state, steps)
        with loader(store, per=per_step) as one:  # the stratified global batches, one rank
            one.load_state_dict({**one.state_dict(), "consumed_samples": start})
            ref = take(one, steps)
        for k, want in enumerate(ref):
            costs = row_costs(*row_segments(want["segment_ids"]))
            a = np.sort(balance_rows(costs, world=world).reshape(world, -1), axis=1)
            for r in range(world):
                assert all(np.array_equal(got[r][k][key], want[key][a[r]]) for key in want), \
                    f"W={world}, rank {r}, step {k} after resuming at {start}"
    assert state["consumed_samples"] == per_step * (4 + 5 + 3)


def test_the_loaders_max_mean_per_step_is_the_benchmark_s(store, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    bench = importlib.import_module("balance")
    world, per, steps = 4, 3, 30
    want = bench.per_step(bench.real_rows(store, L, world * per * steps, stratify=True),
                          world, per, steps)
    ranks = [loader(store, rank=r, world=world, per=per, seed=0) for r in range(world)]
    got = [imbalance([row_costs(*row_segments(b["segment_ids"])).sum() for b in step])
           for step in zip(*(take(ld, steps) for ld in ranks))]
    stats = ranks[0].stats()["balance"]  # the last step's, from the layout alone
    for ld in ranks:
        ld.close()
    sys.modules.pop("balance", None)
    assert got == want and len(got) == steps
    assert stats["step"] == steps - 1 and stats["max_mean"] == got[-1]
    assert max(got) > 1.0  # not all trivially balanced: the figure is measured


def test_stratify_off_keeps_the_fingerprint_and_on_is_part_of_the_state(store):
    with loader(store, stratify=False) as off, loader(store) as on, \
            Loader(store, seq_len=L, batch_size=1, seed=3, layout="packed", num_workers=0,
                   balance="attention") as absent:
        old = xxhash.xxh3_64_hexdigest(json.dumps([off.plan.fingerprint, "balance", [0.5, 0.5]])
                                       .encode())  # the balanced fingerprint before stratify
        assert off.fingerprint == absent.fingerprint == old != on.fingerprint
        assert "stratify" not in json.dumps(off.state_dict())
        take(on, 2)
        with pytest.raises(ConfigError, match="stratify golden-v1 → off"):
            off.load_state_dict(on.state_dict())
        with pytest.raises(ConfigError, match="stratify off → golden-v1"):
            on.load_state_dict(off.state_dict())


def test_stratify_without_balance_or_with_a_mixture_is_refused(store, tmp_path):
    with pytest.raises(ConfigError, match="stratify=True orders one store's rows .* no balance"):
        Loader(store, seq_len=L, batch_size=1, layout="packed", stratify=True)
    other = write_positional_store(tmp_path / "o", [40] * 50, offset=10**7)
    with pytest.raises(ConfigError, match="a mixture of stores"):
        Loader({store: 0.5, other: 0.5}, seq_len=L, batch_size=1, layout="packed",
               balance="attention", stratify=True)
    with pytest.raises(ConfigError, match="stratify must be True or False"):
        loader(store, stratify="yes")
