"""Loader(balance=…, microbatches=m): a rank's rows come in m runs of equal cost (issue 25).
Real Loaders on a positional store of skewed document lengths, compared with the pure core and
with the same Loader at m = 1: exact equalities and counts, no clocks."""

import json

import numpy as np
import pytest
import xxhash
from conftest import assert_resumes_exactly, take, write_positional_store

from tokenmill import Loader, Meter
from tokenmill.base.errors import ConfigError
from tokenmill.load.balance import imbalance, microbatch_rows, row_costs, row_segments

L = 32


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Mostly short documents (1 … 4 tokens) and a few long ones (20 … 3·L), over shards: some
    rows hold one long document, others many short ones."""
    rng = np.random.default_rng(2025)
    long = rng.random(3000) < 0.12
    lengths = np.where(long, rng.integers(20, 3 * L, 3000), rng.integers(1, 5, 3000))
    return write_positional_store(tmp_path_factory.mktemp("micro") / "s", lengths,
                                  shard_tokens=4000)


def loader(store, *, rank: int, world: int, per: int, **kw) -> Loader:
    return Loader(store, seq_len=L, batch_size=per, seed=5, rank=rank, world_size=world,
                  layout="packed", balance="attention", num_workers=0, **kw)


def rows(batch: dict, lo: int = 0, hi: int | None = None) -> list[tuple]:
    """Rows lo … hi − 1 of a batch, each one hashable tuple of all its arrays' values."""
    keys = sorted(batch)
    return [tuple(np.concatenate([batch[k][i].astype(np.int64) for k in keys]).tolist())
            for i in range(lo, len(batch["inputs"]) if hi is None else hi)]


def micro_costs(batch: dict, m: int) -> np.ndarray:
    """The cost of each of a batch's m microbatches (rows [i·B/m, (i+1)·B/m)), from its
    segment_ids."""
    return row_costs(*row_segments(batch["segment_ids"])).reshape(m, -1).sum(axis=1)


def digest(batches: list[dict]) -> str:
    h = xxhash.xxh3_64()
    for b in batches:
        for k in sorted(b):
            h.update(k.encode() + b[k].tobytes())
    return h.hexdigest()


# computed on main before microbatches existed (commit a31a100): rank 1 of 2, 8 rows, 6 steps
MAIN_FINGERPRINT = "93898d93fee1933b"
MAIN_DIGEST = "2626448a21ddc32f"


def test_microbatches_1_is_main_s_stream_byte_for_byte(store):
    for kw in ({}, {"microbatches": 1}):
        with loader(store, rank=1, world=2, per=8, **kw) as ld:
            assert (ld.fingerprint, digest(take(ld, 6))) == (MAIN_FINGERPRINT, MAIN_DIGEST)
            assert "microbatches" not in ld.state_dict()["stream"]
            assert "microbatch_max_mean" not in ld.stats()["balance"]


def test_each_rank_keeps_its_dealt_rows_in_microbatches_of_near_equal_cost(store):
    """m = 4, 2 ranks of 8 rows, 200 steps: a rank's rows are its m = 1 rows (one deal), each
    microbatch ascending in global order as the pure ``microbatch_rows`` puts them; and max /
    mean cost across (rank, microbatch) beats the m = 1 order cut in 4, median over the steps."""
    world, per, m, steps = 2, 8, 4, 200
    one, four = [], []
    for r in range(world):
        with loader(store, rank=r, world=world, per=per) as ld:
            one.append(take(ld, steps))
        with loader(store, rank=r, world=world, per=per, microbatches=m) as ld:
            four.append(take(ld, steps))
    got, before = [], []
    for k in range(steps):
        for r in range(world):
            a, b = one[r][k], four[r][k]
            assert sorted(rows(b)) == sorted(rows(a)), f"step {k} rank {r}: other rows"
            order = microbatch_rows(row_costs(*row_segments(a["segment_ids"])), np.arange(per),
                                    micro=m)
            assert all(np.array_equal(b[key], a[key][order]) for key in a), (k, r)
        got.append(imbalance(np.concatenate([micro_costs(four[r][k], m) for r in range(world)])))
        before.append(imbalance(np.concatenate([micro_costs(one[r][k], m)
                                                for r in range(world)])))
    got, before = np.array(got), np.array(before)
    assert np.median(got) < np.median(before), (np.median(got), np.median(before))
    assert np.count_nonzero(got <= before + 1e-12) > steps * 0.9


def test_stats_report_max_mean_across_microbatches(store):
    world, per, m = 2, 8, 4
    dealt, in_order = [], []
    for r in range(world):
        with loader(store, rank=r, world=world, per=per, microbatches=m) as ld:
            dealt.append(take(ld, 3)[2])
            got = ld.stats()["balance"]
        with loader(store, rank=r, world=world, per=per) as ld:
            in_order.append(take(ld, 3)[2])
            assert got["max_mean"] == ld.stats()["balance"]["max_mean"]  # ranks: as at m = 1
    assert got["step"] == 2 and got["microbatches"] == m
    assert got["microbatch_max_mean"] == pytest.approx(
        imbalance(np.concatenate([micro_costs(b, m) for b in dealt])), rel=1e-12)
    assert got["microbatch_max_mean_in_order"] == pytest.approx(
        imbalance(np.concatenate([micro_costs(b, m) for b in in_order])), rel=1e-12)


def test_the_meter_reports_max_mean_across_microbatches(store):
    """The Meter's periodic line over rank 0 (logged as step 6 ends: the step handed out last is
    step 5) shows max / mean across every (rank, microbatch), dealt and in global order, equal
    to the figures computed from every rank's step-5 batch's segment_ids."""
    world, per, m = 2, 8, 4
    dealt, in_order, lines = [], [], []
    for r in range(world):
        with loader(store, rank=r, world=world, per=per, microbatches=m) as ld:
            dealt.append(take(ld, 6)[5])
        with loader(store, rank=r, world=world, per=per) as ld:
            in_order.append(take(ld, 6)[5])
    with loader(store, rank=0, world=world, per=per, microbatches=m) as ld:
        take(Meter(ld, report_every=6, log=lines.append), 7)
    want = (imbalance(np.concatenate([micro_costs(b, m) for b in dealt])),
            imbalance(np.concatenate([micro_costs(b, m) for b in in_order])))
    assert want[0] < want[1]  # a figure that says something
    assert len(lines) == 1 and f"microbatches {want[0]:.3f} (in order {want[1]:.3f})" in lines[0]
    with loader(store, rank=0, world=world, per=per) as ld:
        meter = Meter(ld)
        take(meter, 3)
        assert "| balance " in meter.report() and "microbatches" not in meter.report()


def test_resumes_exactly_at_every_step_with_microbatches(store):
    assert_resumes_exactly(lambda: loader(store, rank=1, world=3, per=4, microbatches=2), 8)


def test_elastic_resume_2_to_3_ranks_with_microbatches(store):
    """6 rows × 2 ranks, then 4 × 3, m = 2: the steps after the switch are the ranks' rows of
    the global batch at that sample, as fresh loaders on 3 ranks started there give them."""
    state, per_step = None, 12
    for r in range(2):
        with loader(store, rank=r, world=2, per=6, microbatches=2) as ld:
            take(ld, 5)
            state = json.loads(json.dumps(ld.state_dict()))
    assert state["consumed_samples"] == 5 * per_step
    after, whole = [], []
    for r in range(3):
        with loader(store, rank=r, world=3, per=4, microbatches=2) as ld:
            ld.load_state_dict(state)
            after.append(take(ld, 3))
            want = [ld.batch_at(state["consumed_samples"] + k * per_step) for k in range(3)]
            assert all(np.array_equal(g[key], w[key]) for g, w in zip(after[-1], want) for key in w)
    with Loader(store, seq_len=L, batch_size=per_step, seed=5, layout="packed",
                num_workers=0) as plain:
        plain.load_state_dict({**plain.state_dict(), "consumed_samples": 5 * per_step})
        whole = take(plain, 3)
    for k in range(3):
        assert sorted(x for r in range(3) for x in rows(after[r][k])) == sorted(rows(whole[k]))


def test_misuse_is_refused_in_one_line(store):
    with pytest.raises(ConfigError, match=r"batch_size=6 is not a multiple of microbatches=4: .*"
                       r"make batch_size a multiple of 4"):
        loader(store, rank=0, world=2, per=6, microbatches=4)
    with pytest.raises(ConfigError, match=r"microbatches=2 .* give balance='attention'"):
        Loader(store, seq_len=L, batch_size=4, layout="packed", microbatches=2)
    with pytest.raises(ConfigError, match="microbatches"):
        loader(store, rank=0, world=2, per=4, microbatches=0)
    kw = dict(rank=0, world=1, per=4)
    with loader(store, **kw) as one, loader(store, microbatches=2, **kw) as two, \
            loader(store, microbatches=4, **kw) as four:
        take(one, 1)
        take(two, 1)
        with pytest.raises(ConfigError, match="microbatches 1 → 2"):
            two.load_state_dict(one.state_dict())
        with pytest.raises(ConfigError, match="microbatches 2 → 4"):
            four.load_state_dict(two.state_dict())
        with pytest.raises(ConfigError, match="microbatches 2 → 1"):
            one.load_state_dict(two.state_dict())
        three_keys = {k: two.state_dict()[k] for k in ("version", "consumed_samples", "fingerprint")}
        with pytest.raises(ConfigError, match="fingerprint"):
            four.load_state_dict(three_keys)
        two.load_state_dict(two.state_dict())


@pytest.mark.parametrize("layout", ["packed", "concat"])
def test_the_plan_fills_a_permuted_run_of_positions_in_that_order(store, layout):
    """A balanced rank's microbatches may permute a run of positions (first … first + n − 1):
    rows come in the order asked, never the run's."""
    with Loader(store, seq_len=L, batch_size=8, layout=layout, num_workers=0) as ld:
        pos = np.array([18, 23, 22, 19, 24, 21, 20, 25])  # 25 − 18 = 7: the span of a run
        want = ld.plan.new_buffers(8)
        ld.plan.fill(np.sort(pos), want)
        got = ld.plan.new_buffers(8)
        ld.plan.fill(pos, got)
        order = np.argsort(np.argsort(pos))
        assert all(np.array_equal(got[k], want[k][order]) for k in want)
        sid, addr = ld.plan.resolve(pos)
        assert addr.tolist() == ld.plan.resolve(np.sort(pos))[1][order].tolist()
