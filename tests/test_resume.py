"""resume: every batch stream — the store Loader (one store, fixed weights, mixture phases), the
streaming loaders (StreamLoader, MixedStreamLoader) and to_torch's device wrapper (AheadOfLoader)
— keeps one contract (``lifetime.BatchStream``) and continues a state exactly; a state is checked
by one rule (``load.state``): numpy integers accepted, bools refused, mixture phases compared by
what they draw ({a: 0.9, b: 0.1} is {a: 9, b: 1}) in every loader; a resume says what differs."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import MIX_EDITS as EDITS, MIX_OFFSET as OFFSET, MIX_PHASES as PHASES, \
    assert_resumes_exactly, mixture_batches as stream, mixture_loader as make, mixture_stores, \
    same, stdlib_texts, take, write_jsonl, write_positional_store
from tokenmill import Loader
from tokenmill.base.errors import ConfigError, StaleIterator
from tokenmill.cli import main
from tokenmill.load.lifetime import BatchStream

L, B = 8, 4  # seq_len; global batch 4 samples a step (those of mixture_loader)
STEPS = 60  # 240 samples: all three phases, and more than one epoch of "code" and "math"
KINDS = ("Loader", "Loader, fixed weights", "Loader, phases", "to_torch", "StreamLoader",
         "MixedStreamLoader, fixed weights", "MixedStreamLoader, phases")
MIXTURES = KINDS[1:4] + KINDS[5:]  # the streams of two stores or sources weighted (a, b)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return mixture_stores(tmp_path_factory.mktemp("mix"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, str]:
    """Two text folders, "a" and "b", of short real paragraphs: passes of a few dozen samples."""
    root = tmp_path_factory.mktemp("texts")
    out = {}
    for name, pattern in (("a", "json/*.py"), ("b", "email/*.py")):
        docs = [p for t in stdlib_texts(1500, pattern) for p in t.split("\n\n") if p.strip()]
        (root / name).mkdir()
        write_jsonl(root / name / "docs.jsonl", docs)
        out[name] = str(root / name)
    return out


def opener(kind: str, stores, texts, tmp_path, weights=(0.9, 0.1)):
    """A function opening a fresh batch stream of ``kind`` (each streaming one with a cache of its
    own); a mixture's two stores or sources weighted ``weights``, in both phases."""
    a, b = weights
    caches = itertools.count()
    store = dict(seq_len=L, batch_size=B, seed=7, num_workers=0)
    fixed = {stores["web"]: a, stores["code"]: b}

    def make():
        text = dict(tokenizer="bytes", seq_len=16, batch_size=B, seed=3, num_workers=0,
                    shuffle_buffer=4, unit_bytes=1500, cache_dir=tmp_path / f"c{next(caches)}")
        if kind == "Loader":
            return Loader(stores["web"], **store)
        if kind == "Loader, fixed weights":
            return Loader(fixed, **store)
        if kind == "Loader, phases":
            phases = [(0, {"web": a, "code": b}), (12, {"code": a, "math": b})]
            return Loader(stores, mixture=phases, **store)
        if kind == "to_torch":
            pytest.importorskip("torch")
            from tokenmill.integrations.torch import to_torch
            return to_torch(Loader(fixed, **store))
        if kind == "StreamLoader":
            return Loader.from_text([texts["a"]], **text)
        if kind == "MixedStreamLoader, fixed weights":
            return Loader.from_text({texts["a"]: a, texts["b"]: b}, **text)
        assert kind == "MixedStreamLoader, phases"
        return Loader.from_text(texts, mixture=[(0, {"a": a, "b": b}), (12, {"b": a, "a": b})],
                                **text)
    return make


def numpy_ints(value):
    """``value`` with every int in it (not bools) a numpy integer of the narrowest signed width."""
    if isinstance(value, dict):
        return {k: numpy_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [numpy_ints(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return next(t(value) for t in (np.int8, np.int16, np.int32, np.int64)
                    if np.iinfo(t).min <= value <= np.iinfo(t).max)
    return value


# ---- one contract, one check of a state, for every batch stream --------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_every_batch_stream_resumes_exactly_at_every_step(kind, stores, texts, tmp_path):
    make = opener(kind, stores, texts, tmp_path)
    with make() as stream:
        assert isinstance(stream, BatchStream)
    assert_resumes_exactly(make, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_an_earlier_iterator_of_any_stream_raises_stale_iterator(kind, stores, texts, tmp_path):
    with opener(kind, stores, texts, tmp_path)() as stream:
        first = iter(stream)
        take(first, 2)
        second = iter(stream)
        with pytest.raises(StaleIterator, match=r"^this loader was iterated again \(a new iter\(\) "
                                                r"on it\) .* from consumed_samples=8\. Keep one"):
            next(first)
        take(second, 1)
        stream.load_state_dict(stream.state_dict())
        with pytest.raises(StaleIterator, match="state was loaded .* consumed_samples=12"):
            next(second)
        third = iter(stream)
    with pytest.raises(StaleIterator, match="^this loader is closed$"):
        next(third)


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_of_numpy_integers_loads_in_every_stream_and_a_bool_never(kind, stores, texts,
                                                                          tmp_path):
    make = opener(kind, stores, texts, tmp_path)
    with make() as a:
        take(a, 3)
        state = a.state_dict()
        ref = take(a, 3)
    with make() as b:
        b.load_state_dict(numpy_ints(state))
        assert same(take(b, 3), ref)
        for key, bad in (("version", True), ("version", 1.0), ("consumed_samples", True),
                         ("consumed_samples", 12.0)):
            with pytest.raises(ConfigError, match=key):
                b.load_state_dict({**state, key: bad})


@pytest.mark.parametrize("kind", MIXTURES)
def test_a_mixture_respelled_resumes_exactly_in_every_loader(kind, stores, texts, tmp_path):
    saved = opener(kind, stores, texts, tmp_path / "saved", weights=(0.9, 0.1))
    respelled = opener(kind, stores, texts, tmp_path / "respelled", weights=(9, 1))
    with saved() as ref_stream:
        ref = take(ref_stream, 10)
    with saved() as a:
        take(a, 4)  # 16 samples: past the start of both phases (0 and 12)
        state = json.loads(json.dumps(a.state_dict()))
    with respelled() as b:
        b.load_state_dict(state)
        assert same(take(b, 6), ref[4:])


@pytest.mark.parametrize("kind", MIXTURES)
def test_another_mixture_is_refused_naming_what_differs(kind, stores, texts, tmp_path):
    with opener(kind, stores, texts, tmp_path / "saved")() as a:
        take(a, 4)
        state = json.loads(json.dumps(a.state_dict()))
    want = {"Loader, fixed weights": "weights [0.9, 0.1] → [0.8, 0.2]",
            "to_torch": "weights [0.9, 0.1] → [0.8, 0.2]",
            "Loader, phases": "phase 0 (from sample 0) changed {'web': 0.9, 'code': 0.1} → "
                              "{'web': 0.8, 'code': 0.2}, but it started before the checkpoint",
            "MixedStreamLoader, fixed weights": f"fixed weights {{{texts['a']!r}: 0.9, "
                                                f"{texts['b']!r}: 0.1}} → {{{texts['a']!r}: 0.8, "
                                                f"{texts['b']!r}: 0.2}}",
            "MixedStreamLoader, phases": "phase 0 (from sample 0) changed {'a': 0.9, 'b': 0.1} → "
                                         "{'a': 0.8, 'b': 0.2}, but it started before the "
                                         "checkpoint"}[kind]
    with opener(kind, stores, texts, tmp_path / "other", weights=(0.8, 0.2))() as b:
        with pytest.raises(ConfigError) as e:
            b.load_state_dict(state)
        assert want in str(e.value)
        assert b.state_dict()["consumed_samples"] == 0  # refused: nothing changed


# ---- a store mixture's schedule: resumes, edits, explanations ------------------------------------

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
