"""Mixture schedules: named stores whose weights change at given samples resume exactly (any step,
any world size, across phase boundaries, with future phases edited); every store's draws are its
own sequence, never repeated or skipped; a resume says what differs."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import lengths_summing_to, same, take, write_positional_store
from tokenmill.load import sampler
from tokenmill.cli import main
from tokenmill.base.errors import ConfigError
from tokenmill.load.loader import Loader

L, B = 8, 4  # seq_len; global batch 4 samples a step
OFFSET = 1_000_000  # store i's tokens are i·OFFSET + position: a row names its store
NAMES = ("web", "code", "math")
PHASES = [(0, {"web": 0.9, "code": 0.1}), (40, {"web": 0.6, "code": 0.3, "math": 0.1}),
          (100, {"code": 0.5, "math": 0.5})]
EDITS = {  # future edits: the first sample each one changes
    "reweigh": (100, PHASES[:2] + [(100, {"web": 1.0})]),
    "move": (100, PHASES[:2] + [(120, PHASES[2][1])]),
    "add": (200, PHASES + [(200, {"web": 0.2, "math": 0.8})]),
}
STEPS = 60  # 240 samples: all three phases, and more than one epoch of "code" and "math"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    sizes = {"web": 700, "code": 300, "math": 200}  # tokens: about 86, 36 and 24 concat samples
    return {n: str(write_positional_store(
        root / n, lengths_summing_to(sizes[n], docs=sizes[n] // 12, longest=20, seed=i),
        offset=i * OFFSET)) for i, n in enumerate(NAMES)}


def make(stores, *, mixture=PHASES, layout="concat", rank=0, world_size=1):
    return Loader(stores, seq_len=L, batch_size=B // world_size, layout=layout, seed=7,
                  rank=rank, world_size=world_size, num_workers=0, mixture=mixture)


def stream(stores, steps=STEPS, **kw) -> list[dict]:
    with make(stores, **kw) as ld:
        return take(ld, steps)


def resumed(stores, state, steps, *, world_size=1, **kw) -> list[dict]:
    """The next ``steps`` global batches after ``state``, from ``world_size`` fresh loaders whose
    rank slices are put back together in rank order."""
    parts = []
    for r in range(world_size):
        with make(stores, rank=r, world_size=world_size, **kw) as ld:
            ld.load_state_dict(state)
            parts.append(take(ld, steps))
    return [{k: np.concatenate([p[i][k] for p in parts]) for k in parts[0][i]}
            for i in range(steps)]


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_resume_at_random_steps_boundaries_world_sizes_and_future_edits(stores, layout):
    ref = {None: stream(stores, layout=layout)}
    for name, (_, phases) in EDITS.items():
        ref[name] = stream(stores, layout=layout, mixture=phases)
    rng = np.random.default_rng(0)
    trials = 50 if layout == "concat" else 12
    steps = [10, 25, 10, 25, 0, STEPS] + rng.integers(0, STEPS + 1, size=trials - 6).tolist()
    for i, k in enumerate(steps):
        W = [1, 2, 4][i % 3]
        edit = [None, *EDITS][i % 4]
        if edit is not None and EDITS[edit][0] < k * B:
            edit = None  # that edit would change consumed samples: see the refusal test
        with make(stores, layout=layout) as a:
            assert same(take(a, k), ref[None][:k])
            state = json.loads(json.dumps(a.state_dict()))
        mixture = PHASES if edit is None else EDITS[edit][1]
        assert same(ref[edit][:k], ref[None][:k])  # the edit leaves the checkpointed past alone
        got = resumed(stores, state, STEPS - k, world_size=W, layout=layout, mixture=mixture)
        assert same(got, ref[edit][k:]), f"resume at step {k}, world size {W}, edit {edit}"


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


def test_an_edit_to_a_consumed_phase_is_refused_naming_it(stores):
    with make(stores) as a:
        take(a, 15)  # 60 samples: inside phase 1, which starts at sample 40
        state = a.state_dict()
    edited = [PHASES[0], (40, {"web": 0.5, "code": 0.5}), PHASES[2]]
    with make(stores, mixture=edited) as b:
        with pytest.raises(ConfigError, match=r"phase 1 \(from sample 40\) changed"):
            b.load_state_dict(state)
    with make(stores, mixture=[PHASES[0], (50, PHASES[1][1])]) as b:
        with pytest.raises(ConfigError, match=r"phase 1 \(from sample 40\) was removed"):
            b.load_state_dict(state)
    with make(stores, mixture=[*PHASES[:2], (70, {"web": 1.0})]) as b:  # after: fine
        b.load_state_dict(state)


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


def test_a_resume_says_what_differs_and_what_is_safe(stores, tmp_path):
    with make(stores) as a:
        take(a, 3)
        state = a.state_dict()
    other = dict(stores, code=str(write_positional_store(tmp_path / "code2", [15] * 25,
                                                          offset=OFFSET)))
    with make(other) as b:
        with pytest.raises(ConfigError, match="store 'code' was re-prepared: fingerprint "
                                              r"\w+… → \w+…"):
            b.load_state_dict(state)
    with Loader(stores, seq_len=2 * L, batch_size=B, seed=7, num_workers=0,
                mixture=PHASES) as b:
        with pytest.raises(ConfigError, match="seq_len 8 → 16") as e:
            b.load_state_dict(state)
        assert "safe to change" not in str(e.value)
    with make(stores, world_size=2) as b:  # safe: loads, and the report says why
        b.load_state_dict(state)
        assert [d.what for d in b.resume_report(state)] == ["batch_size 4 → 2", "world_size 1 → 2"]
        assert all(d.safe for d in b.resume_report(state))


def test_old_three_key_states_still_load(stores):
    with Loader(stores["web"], seq_len=L, batch_size=B, num_workers=0) as a:
        take(a, 2)
        state = {k: a.state_dict()[k] for k in ("version", "consumed_samples", "fingerprint")}
    with Loader(stores["web"], seq_len=L, batch_size=B, num_workers=0) as b:
        b.load_state_dict(state)
        assert b.consumed_samples == 2 * B
    with Loader(stores["web"], seq_len=L, batch_size=B, seed=1, num_workers=0) as b:
        with pytest.raises(ConfigError, match="fingerprint"):
            b.load_state_dict(state)


def test_resume_check_on_the_command_line(stores, tmp_path, capsys):
    with make(stores) as a:
        take(a, 15)
        (tmp_path / "state.json").write_text(json.dumps(a.state_dict()))
    named = [f"{n}={p}" for n, p in stores.items()]
    args = ["resume-check", str(tmp_path / "state.json"), *named, "--seq-len", str(L),
            "--seed", "7"]
    assert main([*args, "--batch-size", "2", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "safe      batch_size 4 → 2" in out and "resumes exactly at consumed_samples=60" in out
    edited = json.dumps([[0, {"web": 1}]])
    assert main([*args, "--batch-size", "4", "--mixture", edited]) == 1
    out = capsys.readouterr().out
    assert "NOT SAFE  phase 1 (from sample 40) was removed" in out
    assert "safe      phase 2 (from sample 100) was removed (starts after the checkpoint)" in out


def test_resume_in_a_fresh_process(stores, tmp_path):
    with make(stores) as a:
        take(a, 23)
        state = a.state_dict()
    ref = stream(stores)[23:]
    code = (f"import json, sys, numpy as np\nfrom tokenmill import Loader\n"
            f"ld = Loader({stores!r}, seq_len={L}, batch_size={B}, seed=7, num_workers=0, "
            f"mixture={PHASES!r})\nld.load_state_dict(json.loads(sys.argv[1]))\nit = iter(ld)\n"
            f"np.save(sys.argv[2], np.stack([next(it)['inputs'].copy() "
            f"for _ in range({len(ref)})]))\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(state), str(tmp_path / "out.npy")],
                   check=True)
    got = np.load(tmp_path / "out.npy")
    assert np.array_equal(got, np.stack([b["inputs"] for b in ref]))


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


def test_the_same_weights_spelled_otherwise_are_the_same_phase(stores):
    with make(stores) as a:
        take(a, 15)
        state = a.state_dict()
    state["consumed_samples"] = np.int64(state["consumed_samples"])  # numpy ints are fine
    scaled = [(s, {n: 10 * w for n, w in ws.items()}) for s, ws in PHASES]
    with make(stores, mixture=scaled) as b:
        assert b.resume_report(state) == []
        b.load_state_dict(state)
    with make(stores, mixture=[PHASES[0], (40, {"web": 0.5, "code": 0.5})]) as b:
        assert [d.safe for d in b.resume_report(state)] == [False, True]
