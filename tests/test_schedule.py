"""Mixture schedules: named stores whose weights change at given samples; every store's draws are
its own sequence, never repeated or skipped, across phases and epochs; the phases checked at the
door. (Resuming a schedule: tests/test_resume.py.)"""

import json

import numpy as np
import pytest

from conftest import MIX_EDITS as EDITS, MIX_NAMES as NAMES, MIX_OFFSET as OFFSET, \
    MIX_PHASES as PHASES, mixture_batches as stream, mixture_loader as make, mixture_stores, \
    same, take
from tokenmill.load import sampler
from tokenmill.cli import main
from tokenmill.base.errors import ConfigError
from tokenmill.load.loader import Loader

L, B = 8, 4  # seq_len; global batch 4 samples a step (those of mixture_loader)
STEPS = 60  # 240 samples: all three phases, and more than one epoch of "code" and "math"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return mixture_stores(tmp_path_factory.mktemp("mix"))


def draws_by_store(batches) -> dict[int, list[int]]:
    """Per store (by token offset), the start token of every row, in stream order."""
    out: dict[int, list[int]] = {}
    for b in batches:
        for row in b["inputs"]:
            assert np.array_equal(row, row[0] + np.arange(L)), "a row is not one window"
            out.setdefault(int(row[0]) // OFFSET, []).append(int(row[0]))
    return out


@pytest.mark.parametrize("edit", [None, *EDITS])
def test_every_store_draws_its_own_sequence_across_phases_and_epochs(stores, edit):
    mixture = PHASES if edit is None else EDITS[edit][1]
    with make(stores, mixture=mixture) as ld:
        got = draws_by_store(take(ld, STEPS))
        for s, starts in got.items():  # the k-th draw is the store's own k-th sample
            source = ld.plan.sources[s]
            own = source.addresses(np.arange(len(starts))) + s * OFFSET
            want = [hash(np.arange(a, a + L).tobytes()) for a in own.tolist()]
            assert [hash(np.arange(a, a + L).tobytes()) for a in starts] == want, NAMES[s]
        # and across epochs: some store ran past the end of its first epoch
        assert any(len(got[s]) > ld.plan.sources[s].num_samples for s in got)


def test_within_each_phase_every_prefix_keeps_the_weights_within_one():
    weights = [[w.get(n, 0) for n in NAMES] for _, w in PHASES]
    ph = sampler.phased_schedule([(s, w) for (s, _), w in zip(PHASES, weights)])
    store, draw = sampler.assign_phased(ph, np.arange(400))
    ends = [40, 100, 400]
    for i, start in enumerate(ph.starts):
        sid = store[start:ends[i]]
        achieved = np.zeros(3)
        achieved[ph.stores[i]] = ph.schedules[i].weights
        counts = np.cumsum(sid[:, None] == np.arange(3), axis=0)
        n = np.arange(1, len(sid) + 1)[:, None]
        assert np.all(np.abs(counts - n * achieved) < 1 + 1e-9), f"phase {i}"
    for s in range(3):  # draws of a store count 0, 1, 2, … through every phase
        assert draw[store == s].tolist() == list(range(int((store == s).sum())))


def test_spelling_is_checked_at_the_door(stores):
    for bad, match in [([(5, {"web": 1})], "first at 0"),
                       ([(0, {"web": 1}), (0, {"code": 1})], "no two at the same"),
                       ([(0, {"wbe": 1})], "names store 'wbe'"),
                       ([(0, {"web": -1})], ">= 0"), ([(0, {"web": 0})], "no store"),
                       ({"web": 1}, "list of")]:
        with pytest.raises(ConfigError, match=match):
            make(stores, mixture=bad)
    with pytest.raises(ConfigError, match="named stores"):
        Loader(stores["web"], seq_len=L, batch_size=B, mixture=PHASES)
    with pytest.raises(ConfigError, match="needs mixture="):
        Loader(stores, seq_len=L, batch_size=B)
    with pytest.raises(ConfigError, match="maps names to stores"):
        Loader({"web": 0.5, "code": 0.5}, seq_len=L, batch_size=B, mixture=PHASES)


def test_the_guide_runs(tmp_path):
    from conftest import run_guide
    done = run_guide("mixing.md", tmp_path)
    assert "phase 1 (from sample 160) changed" in done.stdout


def test_process_workers_and_the_torch_dataset_follow_the_schedule(stores):
    ref = stream(stores, steps=30)
    with Loader(stores, seq_len=L, batch_size=B, seed=7, num_workers=2, worker_type="process",
                mixture=PHASES) as ld:
        assert same(take(ld, 30), ref)
    pytest.importorskip("torch")
    from tokenmill.integrations.torch import TokenDataset
    with make(stores) as ld:
        take(ld, 12)
        ds = TokenDataset(ld)
        assert ds.state_dict() == ld.state_dict()
        assert same(take(ds, 18), ref[12:])
        with make(stores, mixture=[PHASES[0], (50, PHASES[1][1])]) as edited:
            other = TokenDataset(edited)
            with pytest.raises(ConfigError, match=r"phase 1 \(from sample 40\) was removed"):
                other.load_state_dict(ld.state_dict())


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_explain_names_the_document_pieces_of_every_row(stores, layout, capsys):
    from tokenmill.store import TokenStore
    with make(stores, layout=layout, rank=1, world_size=2) as ld:
        opened = [TokenStore(p) for p in stores.values()]
        for step in (0, 9, 10, 24, 25, 40):  # before, at and after phase boundaries
            batch = ld.batch_at(step * B)
            for o in ld.explain(step):
                s = NAMES.index(o.store)
                assert o.position == step * B + B // 2 + o.row and o.draw >= 0
                row = np.append(batch["inputs"][o.row], batch["targets"][o.row][-1])
                got = np.concatenate([opened[s][p.document][p.token_offset:
                                                             p.token_offset + p.tokens]
                                      for p in o.pieces])
                assert np.array_equal(got, row[:len(got)]), (step, o)
                n = int(batch["loss_mask"][o.row].sum()) + len(o.pieces) if layout == "packed" \
                    else L + 1
                assert len(got) == n
                for p in o.pieces:
                    assert opened[s].shard_doc_starts[p.shard] + p.shard_document == p.document
                    assert p.source == "source unknown"
        for st in opened:
            st.close()
    named = [f"{n}={p}" for n, p in stores.items()]
    assert main(["explain", *named, "--step", "25", "--seq-len", str(L), "--batch-size",
                 str(B), "--seed", "7", "--layout", layout, "--world-size", "1",
                 *(["--max-segments", "none"] if layout == "packed" else []), "--mixture",
                 json.dumps(PHASES)]) == 0
    assert "row 0  sample 100  store " in capsys.readouterr().out


