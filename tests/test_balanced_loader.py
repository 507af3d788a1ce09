"""Loader(balance=…): each rank takes its cost-balanced share of the global batch (issue 25).
Real Loaders on positional stores, compared with the pure core (``balance.balance_rows`` on the
costs read from the plan-order global batch's segment_ids): exact equalities, no clocks."""

import numpy as np
import pytest
from conftest import assert_resumes_exactly, run_ranks, take, write_positional_store

from tokenmill import Loader, Meter
from tokenmill.load.balance import CostModel, balance_rows, imbalance, rank_costs, row_costs, \
    row_segments
from tokenmill.load.balanced import deal, row_lengths
from tokenmill.base.errors import ConfigError

L = 16


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two positional stores of documents from 1 to 3·L tokens (rows of one long document and
    rows of many short ones), over several shards."""
    tmp = tmp_path_factory.mktemp("bal")
    rng = np.random.default_rng(25)
    a = write_positional_store(tmp / "a", np.minimum(3 * L, 1 + rng.lognormal(1.6, 1.0, 600)
                                                     .astype(int)), shard_tokens=1500)
    b = write_positional_store(tmp / "b", rng.integers(1, 2 * L, size=300), shard_tokens=900,
                               offset=10**8)
    return a, b


SETUPS = {  # name → (source, Loader settings)
    "packed": (lambda s: s[0], {"layout": "packed"}),
    "concat-masks": (lambda s: s[0], {"document_masks": True}),
    "packed-mixture": (lambda s: {s[0]: 0.7, s[1]: 0.3}, {"layout": "packed"}),
}


def reference(source, kw, *, world: int, per: int, steps: int, start: int = 0) -> list[dict]:
    """Plan-order global batches (one rank of world_size 1, batch per × world) from ``start``."""
    with Loader(source, seq_len=L, batch_size=per * world, seed=3, rank=0, world_size=1,
                num_workers=0, **kw) as ld:
        ld.load_state_dict({**ld.state_dict(), "consumed_samples": start})
        return take(ld, steps)


def dealt(batch: dict, world: int, model=CostModel()) -> np.ndarray:
    """The pure deal of a global batch, (world, per): costs from its segment_ids; each rank's
    rows in global order."""
    costs = row_costs(*row_segments(batch["segment_ids"]), model)
    return np.sort(balance_rows(costs, world=world).reshape(world, -1), axis=1)


def rows(batch: dict) -> list[tuple]:
    """Every row of a batch as one hashable tuple of all its arrays' values."""
    keys = sorted(batch)
    return [tuple(np.concatenate([batch[k][i].astype(np.int64) for k in keys]).tolist())
            for i in range(len(batch["inputs"]))]


def balanced(source, kw, *, rank: int, world: int, per: int, **more) -> Loader:
    return Loader(source, seq_len=L, batch_size=per, seed=3, rank=rank, world_size=world,
                  balance="attention", **kw, **more)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_each_rank_gets_its_rows_of_the_pure_deal_and_together_the_global_batch(stores, setup):
    src, kw = SETUPS[setup]
    world, per, steps = 4, 3, 12
    ref = reference(src(stores), kw, world=world, per=per, steps=steps)
    got = []
    for r in range(world):
        with balanced(src(stores), kw, rank=r, world=world, per=per, num_workers=0) as ld:
            got.append(take(ld, steps))
    for k, want in enumerate(ref):
        a = dealt(want, world)
        for r in range(world):
            assert all(np.array_equal(got[r][k][key], want[key][a[r]]) for key in want), (k, r)
        union = sorted(x for r in range(world) for x in rows(got[r][k]))
        assert union == sorted(rows(want)), f"step {k}: the ranks' rows are not the global batch's"


def test_costs_come_from_the_layout_never_from_tokens(stores):
    with balanced(stores[0], {"layout": "packed"}, rank=0, world=4, per=3, num_workers=0) as ld:
        want = ld.plan.new_buffers(12)
        ld.plan.fill(np.arange(24, 36), want)

        def no_tokens(*args):
            raise AssertionError("a deal read tokens")
        store = ld.plan.sources[0].store
        store.shard = store.copy_tokens = store.tokens = no_tokens
        lengths, offsets = row_lengths(ld.plan, np.arange(24, 36))
        assert [a.tolist() for a in (lengths, offsets)] == \
            [a.tolist() for a in row_segments(want["segment_ids"])]
        d = deal(ld.plan, 24, batch_size=3, world_size=4, model=CostModel())
        assert np.array_equal(d.rows, dealt(want, 4))


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_workers_hand_out_the_same_balanced_batches(stores, worker_type):
    kw = {"layout": "packed"}
    with balanced(stores[0], kw, rank=2, world=3, per=4, num_workers=0) as ld:
        want = take(ld, 8)
    with balanced(stores[0], kw, rank=2, world=3, per=4, num_workers=2,
                  worker_type=worker_type) as ld:
        got = take(ld, 8)
    assert all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)


@pytest.mark.parametrize("setup", ["packed", "concat-masks"])
def test_resumes_exactly_at_every_step(stores, setup):
    src, kw = SETUPS[setup]
    assert_resumes_exactly(lambda: balanced(src(stores), kw, rank=1, world=3, per=2,
                                            num_workers=0), 10)


def test_elastic_resume_2_to_3_to_1_ranks_keeps_every_step_whole(stores):
    src, kw = SETUPS["packed"]
    source, per_step, state = src(stores), 12, None
    for world, steps in ((2, 4), (3, 5), (1, 3)):
        per = per_step // world
        got, start, state = run_ranks(
            lambda r: balanced(source, kw, rank=r, world=world, per=per, num_workers=0), world,
            state, steps)
        ref = reference(source, kw, world=world, per=per, steps=steps, start=start)
        for k, want in enumerate(ref):
            a = dealt(want, world)
            for r in range(world):
                assert all(np.array_equal(got[r][k][key], want[key][a[r]]) for key in want)
            assert sorted(x for r in range(world) for x in rows(got[r][k])) == \
                sorted(rows(want)), f"W={world}, step {k} after resuming at {start}"
    assert state["consumed_samples"] == per_step * (4 + 5 + 3)


def test_stats_and_the_meter_report_the_step_s_balance(stores):
    src, kw = SETUPS["packed"]
    world, per = 4, 3
    ref = reference(src(stores), kw, world=world, per=per, steps=3)
    with balanced(src(stores), kw, rank=0, world=world, per=per, num_workers=0) as ld:
        meter = Meter(ld)
        take(meter, 3)
        got = ld.stats()["balance"]
        line = meter.report()
    costs = row_costs(*row_segments(ref[2]["segment_ids"]))
    assert got == {"step": 2, "max_mean": imbalance(rank_costs(costs, dealt(ref[2], world))),
                   "unbalanced_max_mean": imbalance(costs.reshape(world, per).sum(axis=1)),
                   "cost_model": [0.5, 0.5]}
    assert f"balance {got['max_mean']:.3f} (unbalanced {got['unbalanced_max_mean']:.3f})" in line
    with Loader(src(stores), seq_len=L, batch_size=per, num_workers=0, **kw) as plain:
        assert "balance" not in plain.stats()


def test_a_layout_without_documents_or_a_bad_setting_is_refused(stores):
    with pytest.raises(ConfigError, match="balance='attention' needs rows whose documents are "
                       "known: layout='packed', or layout='concat' with document_masks=True"):
        Loader(stores[0], seq_len=L, batch_size=2, balance="attention")
    with pytest.raises(ConfigError, match="balance must be None, 'attention' or"):
        Loader(stores[0], seq_len=L, batch_size=2, layout="packed", balance="flops")


def test_a_state_with_balance_toggled_or_changed_is_refused_naming_it(stores):
    kw = dict(seq_len=L, batch_size=2, layout="packed", num_workers=0)
    with Loader(stores[0], balance="attention", **kw) as on, Loader(stores[0], **kw) as off, \
            Loader(stores[0], balance=CostModel(a=1.0, b=0.0), **kw) as other:
        take(on, 2)
        take(off, 2)
        saved_on, saved_off = on.state_dict(), off.state_dict()
        with pytest.raises(ConfigError, match=r"balance \[0.5, 0.5\] → off"):
            off.load_state_dict(saved_on)
        with pytest.raises(ConfigError, match=r"balance off → \[0.5, 0.5\]"):
            on.load_state_dict(saved_off)
        with pytest.raises(ConfigError, match=r"balance \[0.5, 0.5\] → \[1.0, 0.0\]"):
            other.load_state_dict(saved_on)
        three_keys = {k: saved_on[k] for k in ("version", "consumed_samples", "fingerprint")}
        with pytest.raises(ConfigError, match="fingerprint"):
            off.load_state_dict(three_keys)
        on.load_state_dict(saved_on)  # its own state loads
        assert on.consumed_samples == 4


def test_the_plan_resolves_positions_in_any_order_across_blocks(stores):
    with Loader(stores[0], seq_len=L, batch_size=2, layout="packed", num_workers=0) as ld:
        plan = ld.plan
        pos = np.array([4100, 7, 4095, 9000, 8, 4096])  # three blocks of 4,096, out of order
        one = [plan.resolve(np.array([p])) for p in pos]
        sid, addr = plan.resolve(pos)
        assert sid.tolist() == [int(s[0]) for s, _ in one]
        assert addr.tolist() == [int(a[0]) for _, a in one]


def test_the_balance_guide_runs_as_a_script(tmp_path):
    """docs/balance.md: a balanced run across 4 ranks, checked, resumed on 2, refused unbalanced;
    token-budget (THD) batches checked against the packed rows."""
    import re
    from conftest import run_guide
    done = run_guide("balance.md", tmp_path)
    assert done.stdout.strip().endswith("thd ok")
    assert "resumed on 2 ranks at step 5" in done.stdout
    assert re.search(r"\d+ sequences in 2048 tokens, the longest \d+: cu_seqlens \[0, .*2048\] "
                     r"\+ \d+ empty", done.stdout), done.stdout
