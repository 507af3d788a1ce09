"""Streaming mode with the layouts of stores: packed rows (packed window by window, equal to a
reference built from the documents, to the store Loader's rows when the window holds the whole
input, and to the store Loader's later epochs), and mixtures of text sources; exact resume."""

import json
from collections import Counter
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import assert_resumes_exactly, stdlib_texts, store_bytes, take, write_jsonl
from tokenmill import Loader, prepare
from tokenmill.load.attention import varlen_args
from tokenmill.base.errors import ConfigError
from tokenmill.load.pack import fill_packed_rows, pack_documents
from tokenmill.load.sampler import hash_ints
from tokenmill.streaming import DELAY_TAG
from tokenmill.streaming.rows import pass_layout, window_ends

L, B, S = 32, 4, 16
OPTS = dict(unit_bytes=2500, shard_tokens=15_000)  # many units, several shards
META = ("segment_ids", "positions", "loss_mask")


def documents(limit_bytes, pattern="*.py", long_every=7):
    """Real paragraphs (1 to a few hundred bytes), every ``long_every``-th made longer than a
    row by repeating it, so that some documents must be cut in pieces."""
    docs = []
    for t in stdlib_texts(limit_bytes, pattern):
        docs += [p for p in t.split("\n\n") if p.strip()]
    return [d * (1 + 3 * L // len(d)) if i % long_every == 0 else d for i, d in enumerate(docs)]


def tokens_of(docs):
    """What the bytes tokenizer makes: UTF-8 bytes, EOS (256) after each document."""
    return [np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int32), 256) for d in docs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    docs = documents(20_000)
    write_jsonl(root / "a.jsonl", docs[:len(docs) // 2])
    write_jsonl(root / "b.jsonl", docs[len(docs) // 2:])
    return root, docs


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A pass of a dozen steps: resumed at every step."""
    root = tmp_path_factory.mktemp("small")
    docs = documents(1_000)[:14]
    write_jsonl(root / "a.jsonl", docs)
    return root, docs


def reference_order(n, seed, shuffle_buffer):
    """The documented shuffle buffer: row i leaves at i + hash mod min(S, i + 1), ties by i."""
    i = np.arange(n, dtype=np.int64)
    t = i + (hash_ints(DELAY_TAG, seed, i) % np.minimum(i + 1, shuffle_buffer).astype(np.uint64)
             ).astype(np.int64)
    return i[np.lexsort((i, t))]


def packed_rows(layout, stream, ids):
    """Rows ``ids`` of ``layout`` over the token array ``stream``, with their metadata."""
    shape = (len(ids), layout.seq_len)
    out = {"inputs": np.empty(shape, np.int32), "targets": np.empty(shape, np.int32),
           "segment_ids": np.empty(shape, np.int32), "positions": np.empty(shape, np.int32),
           "loss_mask": np.empty(shape, np.uint8)}
    fill_packed_rows(layout, np.asarray(ids, np.int64), stream, out)
    return out


def make(root, cache, **kw):
    args = dict(tokenizer="bytes", seq_len=L, batch_size=B, cache_dir=cache, seed=0,
                num_workers=0, shuffle_buffer=S, layout="packed", pack_window=6, **OPTS)
    args.update(kw)
    return Loader.from_text([str(root)], **args)


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- the packing windows (pure) ------------------------------------------------------------------

def test_golden_packing_windows_seed_0():
    # Only update if you mean to break users' reproducibility: the pass's packed rows, seed 0.
    # ends 3 10 12 17 18 22 28 30 33 42: windows of W = 10 close at 10, 22 (>= 20), 33 (>= 32)
    lengths = np.array([3, 7, 2, 5, 1, 4, 6, 2, 3, 9])
    plain = pass_layout(lengths, seq_len=4, window=10)
    assert plain.row_ptr.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13]
    assert plain.seg_start.tolist() == [3, 0, 7, 12, 18, 17, 10, 22, 30, 26, 28, 33, 37]
    assert plain.seg_len.tolist() == [5, 3, 3, 5, 4, 1, 2, 5, 3, 2, 2, 5, 5]
    rows = pass_layout(lengths, seq_len=4, window=10, seed=0)  # each window's rows permuted
    assert rows.row_ptr.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]
    assert rows.seg_start.tolist() == [0, 3, 7, 18, 17, 12, 10, 28, 30, 26, 22, 37, 33]
    assert rows.seg_len.tolist() == [3, 5, 3, 4, 1, 5, 2, 2, 3, 2, 5, 5, 5]


def test_a_window_larger_than_the_input_is_the_store_layout():
    lengths = np.array([len(t) for t in tokens_of(documents(20_000))])
    whole = pass_layout(lengths, seq_len=L, window=int(lengths.sum()) + 1)
    ref = pack_documents(lengths, L)
    for name in ("row_ptr", "seg_start", "seg_len", "seg_doc"):
        assert np.array_equal(getattr(whole, name), getattr(ref, name)), name


@pytest.mark.parametrize("max_segments", [None, 3])
def test_windows_split_only_long_documents_and_keep_to_their_window(max_segments):
    lengths = np.array([len(t) for t in tokens_of(documents(20_000))])
    window = 5 * (L + 1)
    layout = pass_layout(lengths, seq_len=L, window=window, max_segments=max_segments)
    closes = np.zeros(len(lengths), bool)
    closes[window_ends(np.cumsum(lengths), 0, window)] = True
    window_of = np.concatenate([[0], np.cumsum(closes)[:-1]])  # each document's packing window
    sizes = np.bincount(window_of, weights=lengths)
    last = np.bincount(window_of, weights=np.where(closes, lengths, 0))
    assert (sizes[:-1] >= window).all() and (sizes[:-1] - last[:-1] < window).all()
    per_doc = np.bincount(layout.seg_doc, weights=layout.seg_len, minlength=len(lengths))
    short = lengths <= L + 1
    assert np.array_equal(per_doc[short], lengths[short])  # short documents: once, whole
    assert np.array_equal(np.bincount(layout.seg_doc)[short], np.ones(short.sum()))
    assert (np.bincount(layout.seg_doc)[~short] > 1).all()  # long ones: cut in pieces
    rows = np.repeat(np.arange(layout.num_rows), np.diff(layout.row_ptr))
    w = window_of[layout.seg_doc]
    assert all(len(set(w[rows == r].tolist())) == 1 for r in range(layout.num_rows))
    assert (np.diff(w[layout.row_ptr[:-1]]) >= 0).all()  # window 0's rows, then window 1's …
    if max_segments:
        assert np.diff(layout.row_ptr).max() <= max_segments


# ---- packed batches ------------------------------------------------------------------------------

def test_packed_pass_equals_the_reference_then_the_store_loader(corpus, tmp_path):
    root, docs = corpus
    toks = tokens_of(docs)
    stream = np.concatenate(toks)
    layout = pass_layout(np.array([len(t) for t in toks]), seq_len=L, window=6 * (L + 1), seed=0)
    n = layout.num_rows
    order = reference_order(n, 0, S)
    steps = n // B + 3
    with make(root, tmp_path / "cache", num_workers=1) as ld:
        got = take(ld, steps)
        assert ld.pass_samples == n and ld.config.layout == "packed"
        assert 0 < ld.buffer_peak_tokens <= ld.buffer_bytes() // 2  # uint16 tokens
        store = ld.store_path
    for j, b in enumerate(got[:n // B]):
        assert same(b, packed_rows(layout, stream, order[j * B:(j + 1) * B])), f"step {j}"
    with Loader(store, seq_len=L, batch_size=1, layout="packed", seed=0,
                num_workers=0) as st:  # past the pass: the store Loader's epochs 1, 2, …
        for j in range(n // B, steps):
            for r, p in enumerate(range(j * B, (j + 1) * B)):
                want = st.batch_at(p - n + st.samples_per_epoch) if p >= n else \
                    packed_rows(layout, stream, [order[p]])
                assert same({k: v[r:r + 1] for k, v in got[j].items()}, want), (j, r)
    prepare([str(root)], out=tmp_path / "prepared", tokenizer="bytes", workers=1,
            progress=False, **OPTS)
    assert store_bytes(store) == store_bytes(tmp_path / "prepared")


def test_with_a_window_over_the_whole_input_the_rows_are_the_store_loaders(corpus, tmp_path):
    root, docs = corpus
    prepare([str(root)], out=tmp_path / "store", tokenizer="bytes", workers=1, progress=False,
            **OPTS)
    with Loader(tmp_path / "store", seq_len=L, batch_size=1, layout="packed",
                num_workers=0) as st:
        n = st.samples_per_epoch
        want = take(st, n)
    with make(root, tmp_path / "cache", pack_window=10 ** 6, batch_size=1) as ld:
        got = take(ld, n)
        assert ld.pass_samples == n

    def rows(batches):
        return sorted(tuple(np.concatenate([b[k][0] for k in ("inputs", "targets", *META)]))
                      for b in batches)
    assert rows(got) == rows(want)  # the same rows (the order differs: shuffle buffer vs Feistel)


def test_packed_metadata_describes_whole_documents(corpus, tmp_path):
    root, docs = corpus
    with make(root, tmp_path / "cache", max_segments=4) as ld:
        batches = take(ld, 1)
        while ld.pass_samples is None:
            batches += take(ld, 10)
        batches = batches[:ld.pass_samples // B]
    pieces = []
    for b in batches:
        assert set(b) == {"inputs", "targets", *META} and b["segment_ids"].dtype == np.int32
        for r in range(B):
            seg, pos = b["segment_ids"][r], b["positions"][r]
            assert seg.max() <= 4
            row = np.append(b["inputs"][r], b["targets"][r][-1])
            for s in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == s)
                assert np.array_equal(pos[at], np.arange(len(at)))  # positions restart at 0
                # the last token of a segment that fills the row is only in the targets
                piece = row[at[0]:at[-1] + 1 + int(b["loss_mask"][r][at[-1]])]
                assert (b["loss_mask"][r][at[:-1]] == 1).all()
                pieces.append(piece)
            pad = seg == 0
            assert (b["loss_mask"][r][pad] == 0).all() and (b["inputs"][r][pad] == 0).all()
        cu = varlen_args(b["segment_ids"]).cu_seqlens
        assert cu[-1] == B * L and (np.diff(cu) > 0).all()
    whole = Counter(tuple(t) for t in tokens_of(docs) if len(t) <= L + 1)
    seen = Counter(tuple(p) for p in pieces if p[-1] == 256 and tuple(p) in whole)
    assert all(seen[d] <= whole[d] for d in seen)  # no short document twice in a pass
    assert seen.total() > 0.8 * whole.total()  # and (but for a partly seen last step) all there


def test_packed_resume_is_exact_across_the_end_of_the_pass(small, tmp_path):
    root, _ = small
    with make(root, tmp_path / "probe") as ld:
        take(ld, 1)
        while ld.pass_samples is None:
            take(ld, 20)
        steps = ld.pass_samples // B + 3
    caches = iter(range(1000))
    assert_resumes_exactly(lambda: make(root, tmp_path / f"c{next(caches)}"), steps)


def test_packed_resume_with_process_workers_and_from_the_cache(corpus, tmp_path):
    root, _ = corpus
    with make(root, tmp_path / "ref") as ld:
        ref = take(ld, 40)
        while not (ld.store_path / "manifest.json").exists():  # to the end of the pass
            take(ld, 20)
    for k, saved_by, resumed_by in ((3, 0, 2), (17, 1, 0)):  # worker processes or none
        with make(root, tmp_path / f"a{k}", num_workers=saved_by) as a:
            take(a, k)
            state = json.loads(json.dumps(a.state_dict()))
        assert "row" in state["resume_from"]
        with make(root, tmp_path / f"b{k}", num_workers=resumed_by) as b:  # from the text
            b.load_state_dict(state)
            assert all(same(x, y) for x, y in zip(take(b, 40 - k), ref[k:]))
        with make(root, tmp_path / "ref", num_workers=0) as c:  # from the complete cache
            c.load_state_dict(state)
            assert all(same(x, y) for x, y in zip(take(c, 40 - k), ref[k:]))


def test_packed_resume_in_a_fresh_process(corpus, tmp_path):
    root, _ = corpus
    with make(root, tmp_path / "a") as a:
        ref = take(a, 30)
    with make(root, tmp_path / "b") as b:
        take(b, 11)
        (tmp_path / "state.json").write_text(json.dumps(b.state_dict()))
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(f"""
        import json, numpy as np, tokenmill
        ld = tokenmill.Loader.from_text([{str(root)!r}], tokenizer="bytes", seq_len={L},
            batch_size={B}, cache_dir={str(tmp_path / "c")!r}, num_workers=1, shuffle_buffer={S},
            layout="packed", pack_window=6, unit_bytes=2500, shard_tokens=15_000)
        ld.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
        out = {{}}
        for j, b in zip(range(19), ld):
            for k, v in b.items():
                out[f"{{j}}/{{k}}"] = v.copy()
        np.savez({str(tmp_path / "out.npz")!r}, **out)
        ld.close()
    """))
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    got = np.load(tmp_path / "out.npz")
    for j in range(19):
        assert same({k: got[f"{j}/{k}"] for k in ref[11 + j]}, ref[11 + j]), j


def test_packed_ranks_take_slices_of_the_global_batch(corpus, tmp_path):
    root, _ = corpus
    with make(root, tmp_path / "one", batch_size=2 * B) as one:
        want = take(one, 6)
    for rank in (0, 1):
        with make(root, tmp_path / "two", rank=rank, world_size=2) as ld:
            got = take(ld, 6)
        assert all(same(g, {k: v[rank * B:(rank + 1) * B] for k, v in w.items()})
                   for g, w in zip(got, want))


def test_packed_resume_on_a_partial_cache_written_less_far(corpus, tmp_path, monkeypatch):
    from tokenmill.streaming import units
    init = units.UnitResults.__init__
    root, _ = corpus
    small = dict(shard_tokens=3_000)  # shards committed early: the cache's writer has a cursor
    with make(root, tmp_path / "partial", **small) as a:
        take(a, 2)
    assert list((a.store_path / ".progress").glob("shard-*.json"))  # committed: a cursor > 0
    with make(root, tmp_path / "far", **small) as b:
        take(b, 60)
        state = b.state_dict()
        ref = take(b, 10)
    assert state["resume_from"]["row"] > 0
    with make(root, tmp_path / "partial", **small) as c:  # its writer is behind the hint
        c.load_state_dict(state)
        firsts = []
        monkeypatch.setattr(units.UnitResults, "__init__", lambda self, *a, first, **k: (
            firsts.append(first), init(self, *a, first=first, **k))[1])
        assert all(same(x, y) for x, y in zip(take(c, 10), ref))
        assert firsts == [0]  # read from the start: the rows before the writer's cursor
        take(c, 400)  # on to the end of the pass: the partial cache is finished …
    prepare([str(root)], out=tmp_path / "prepared", tokenizer="bytes", workers=1,
            progress=False, **{**OPTS, **small})
    assert store_bytes(c.store_path) == store_bytes(tmp_path / "prepared")  # … as prepare makes it


def test_packed_refusals(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(ConfigError, match="max_segments"):
        make(root, tmp_path / "c", layout="concat", max_segments=2, pack_window=None)
    with pytest.raises(ConfigError, match="layout must be one of"):
        make(root, tmp_path / "c", layout="rows")
    with pytest.raises(ConfigError, match="pack_window"):
        make(root, tmp_path / "c", pack_window=0)
    with make(root, tmp_path / "c") as a:
        take(a, 5)
        state = a.state_dict()
    state["resume_from"]["row"] += 1
    with make(root, tmp_path / "d") as b, pytest.raises(ConfigError, match="resume_from"):
        b.load_state_dict(state)
    with make(root, tmp_path / "d", pack_window=7) as b, pytest.raises(ConfigError,
                                                                       match="fingerprint"):
        b.load_state_dict(a.state_dict())


# ---- mixtures of text sources --------------------------------------------------------------------

NAMES = ("web", "code", "mail")
PHASES = [(0, {"web": 0.6, "code": 0.4}), (24, {"web": 0.2, "code": 0.3, "mail": 0.5}),
          (56, {"mail": 1.0})]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three text sources of different content, one folder each."""
    root = tmp_path_factory.mktemp("sources")
    for name, pattern in zip(NAMES, ("*.py", "json/*.py", "email/*.py")):
        (root / name).mkdir()
        write_jsonl(root / name / "docs.jsonl", documents(6_000, pattern, long_every=5))
    return {name: str(root / name) for name in NAMES}


def mixed(sources, cache, **kw):
    args = dict(tokenizer="bytes", seq_len=L, batch_size=B, cache_dir=cache, seed=0,
                num_workers=0, shuffle_buffer=S, mixture=PHASES, **OPTS)
    args.update(kw)
    return Loader.from_text(sources, **args)


def mixed_reference(sources, tmp_path, steps, *, world_size=1, **kw):
    """Global batches built from each source streamed alone: position p is draw d of source s
    by the store Loader's schedule, and draw d is sample d of that source's own stream."""
    from tokenmill.load.sampler import assign_phased, phased_schedule
    gb = B * world_size
    phases = phased_schedule([(p, [w.get(n, 0.0) for n in NAMES]) for p, w in PHASES])
    sid, draw = assign_phased(phases, np.arange(steps * gb))
    alone = {}
    for s, name in enumerate(NAMES):
        n = int(draw[sid == s].max(initial=-1)) + 1
        args = dict(tokenizer="bytes", seq_len=L, batch_size=1, seed=0, num_workers=0,
                    shuffle_buffer=S, cache_dir=tmp_path / f"alone-{name}", **OPTS)
        args.update(kw)
        with Loader.from_text([sources[name]], **args) as ld:
            alone[s] = take(ld, n)
    rows = [alone[s][d] for s, d in zip(sid.tolist(), draw.tolist())]
    return [{k: np.concatenate([r[k] for r in rows[j * gb:(j + 1) * gb]]) for k in rows[0]}
            for j in range(steps)]


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_a_mixture_equals_its_sources_streamed_alone_on_every_rank(sources, tmp_path, layout):
    kw = {} if layout == "concat" else dict(layout="packed", pack_window=4)
    steps = 20  # across both phase boundaries (global samples 24 and 56 with 2 ranks × 4)
    ref = mixed_reference(sources, tmp_path, steps, world_size=2, **kw)
    for rank in (0, 1):
        with mixed(sources, tmp_path / f"mix{rank}", rank=rank, world_size=2, **kw) as ld:
            got = take(ld, steps)
            state = ld.state_dict()
        for j, b in enumerate(got):
            want = {k: v[rank * B:(rank + 1) * B] for k, v in ref[j].items()}
            assert same(b, want), (rank, j)
    with mixed(sources, tmp_path / "one", batch_size=2 * B, world_size=1, rank=0, **kw) as one:
        assert all(same(x, y) for x, y in zip(take(one, 5), ref[:5]))  # one rank, the same
        state1 = json.loads(json.dumps(one.state_dict()))
    with mixed(sources, tmp_path / "two", rank=1, world_size=2, **kw) as two:
        two.load_state_dict(state1)  # resumed on another world size
        assert all(same(x, {k: v[B:] for k, v in y.items()}) for x, y in zip(take(two, 9), ref[5:]))
    # each source's cursor: its draws so far, whatever the phases
    assert {n: state["sources"][n]["consumed_samples"] for n in NAMES} == \
        {"web": 21, "code": 19, "mail": 120}  # 0.6·24 + 0.2·32, 0.4·24 + 0.3·32, 0.5·32 + 104
    assert state["mixture"] == [[0, {"web": 0.6, "code": 0.4}],
                                [24, {"web": 0.2, "code": 0.3, "mail": 0.5}], [56, {"mail": 1.0}]]


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_a_mixture_resumes_exactly_at_every_step_across_phase_boundaries(sources, tmp_path,
                                                                          layout):
    kw = {} if layout == "concat" else dict(layout="packed", pack_window=4)
    caches = iter(range(1000))
    assert_resumes_exactly(lambda: mixed(sources, tmp_path / f"c{next(caches)}", **kw), 17)


def test_a_mixture_resumes_with_process_workers_in_a_fresh_process(sources, tmp_path):
    with mixed(sources, tmp_path / "a") as a:
        ref = take(a, 20)
    with mixed(sources, tmp_path / "b") as b:
        take(b, 6)  # the next batch straddles the phase boundary at 24
        (tmp_path / "state.json").write_text(json.dumps(b.state_dict()))
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(f"""
        import json, numpy as np, tokenmill
        ld = tokenmill.Loader.from_text({sources!r}, tokenizer="bytes", seq_len={L},
            batch_size={B}, cache_dir={str(tmp_path / "b")!r}, num_workers=2, shuffle_buffer={S},
            mixture={PHASES!r}, unit_bytes=2500, shard_tokens=15_000)
        ld.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
        np.save({str(tmp_path / "out.npy")!r},
                np.stack([b["inputs"].copy() for _, b in zip(range(14), ld)]))
        ld.close()
    """))
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    got = np.load(tmp_path / "out.npy")
    assert all(np.array_equal(got[j], ref[6 + j]["inputs"]) for j in range(14))


def test_future_phases_may_change_past_ones_may_not(sources, tmp_path):
    with mixed(sources, tmp_path / "a") as a:
        take(a, 8)  # 32 samples: phase 1 (from 24) has begun, phase 2 (from 56) has not
        state = json.loads(json.dumps(a.state_dict()))
        ref = take(a, 8)
    edited = PHASES[:2] + [(64, {"web": 1.0})]
    with mixed(sources, tmp_path / "b", mixture=edited) as b:
        b.load_state_dict(state)
        got = take(b, 8)
    assert all(same(x, y) for x, y in zip(got[:6], ref[:6]))  # the same up to sample 56
    assert not same(got[6], ref[6])  # then as edited: phase 1 goes on to 64
    for past in ([(0, {"web": 0.6, "code": 0.4}), (20, PHASES[1][1])],
                 [(0, {"web": 0.5, "code": 0.5}), *PHASES[1:]]):
        with mixed(sources, tmp_path / "c", mixture=past) as c, \
                pytest.raises(ConfigError, match=r"phase [01] .*started before"):
            c.load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["sources"]["web"] = json.loads(json.dumps(state["sources"]["code"]))
    with mixed(sources, tmp_path / "d") as d, pytest.raises(ConfigError, match="fingerprint"):
        d.load_state_dict(bad)


def test_a_mixture_state_rewound_by_a_wrapper_resumes_exactly(sources, tmp_path):
    with mixed(sources, tmp_path / "a") as a:
        ref = take(a, 12)
    with mixed(sources, tmp_path / "c") as c:
        take(c, 9)  # a device wrapper took 3 batches ahead: its state says 6 steps
        state = {**c.state_dict(), "consumed_samples": 6 * B}
    with mixed(sources, tmp_path / "c") as d:
        d.load_state_dict(state)
        assert [s.consumed_samples for s in d.sources] == [15, 9, 0]  # 0.6·24, 0.4·24
        assert all(same(x, y) for x, y in zip(take(d, 6), ref[6:]))


def test_fixed_weights_spelling_and_refusals(sources, tmp_path):
    weights = {sources["web"]: 3.0, sources["code"]: 1.0}
    with Loader.from_text(weights, tokenizer="bytes", seq_len=L, batch_size=B, num_workers=0,
                          cache_dir=tmp_path / "w", shuffle_buffer=S, **OPTS) as ld:
        take(ld, 4)
        state = ld.state_dict()
    assert [state["sources"][n]["consumed_samples"] for n in weights] == [12, 4]
    with pytest.raises(ConfigError, match="named text sources"):
        Loader.from_text(sources["web"], tokenizer="bytes", seq_len=L, batch_size=B,
                         cache_dir=tmp_path / "x", mixture=PHASES)
    with pytest.raises(ConfigError, match="same inputs"):
        Loader.from_text({"a": sources["web"], "b": sources["web"]}, tokenizer="bytes",
                         seq_len=L, batch_size=B, cache_dir=tmp_path / "x",
                         mixture=[(0, {"a": 1.0, "b": 1.0})])
    with pytest.raises(ConfigError, match="names store 'news'"):
        mixed(sources, tmp_path / "x", mixture=[(0, {"news": 1.0})])


@pytest.mark.parametrize("block", [1, 2])  # docs/streaming.md: packed rows, a mixture
def test_the_docs_examples_run_as_scripts(tmp_path, block):
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "streaming.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.S)[block]
    (tmp_path / "example.py").write_text(code)
    res = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    want = ("['inputs', 'loss_mask', 'positions', 'segment_ids', 'targets']" if block == 1
            else "{'web': 480, 'code': 112, 'mail': 48}")
    assert res.stdout.strip() == want
