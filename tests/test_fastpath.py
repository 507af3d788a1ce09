"""The compiled paths write the reference paths' bytes: packed rows, document masks, best fit."""

import numpy as np
import pytest

from conftest import write_token_store
from tokenmill import Loader
from tokenmill.load import fastpath
from tokenmill.load.pack import fill_packed_rows, fill_window_metadata, pack_documents
from tokenmill.load.plan import batch_arrays
from tokenmill.store import TokenStore


def test_the_compiled_filler_is_built_by_the_install():
    # pyproject's ext-modules builds it (optional: without a C compiler the numpy path is used);
    # the suite runs on an install that has one, so every test below compares the two paths
    assert fastpath.fastfill is not None, fastpath.status()
    assert fastpath.status().startswith("compiled")


def both(fill, *, batch: int, seq_len: int, dtype=np.int64, masks: bool = True):
    """``fill(out)`` once through the compiled filler and once through numpy, on buffers
    pre-filled with different garbage: every byte either path leaves is compared."""
    got = {}
    for name, on in (("compiled", True), ("numpy", False)):
        out = batch_arrays(batch, seq_len, dtype, masks)
        for a in out.values():
            a.fill(3 if name == "compiled" else 5)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpath, "ENABLED", on)
            fill(out)
        got[name] = out
    return got["compiled"], got["numpy"]


def assert_same(a: dict, b: dict, rows=slice(None)) -> None:
    """Equal arrays in the batch rows ``rows`` (the others hold each path's garbage)."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k][rows], b[k][rows]), k


def lengths(rng, n: int, seq_len: int) -> np.ndarray:
    cap = seq_len + 1
    edge = [1, 2, cap - 1, cap, cap + 1, 2 * seq_len + 1, 3 * seq_len + 2]
    return np.concatenate([rng.integers(1, 2 * cap, n), rng.integers(1, 6, n), edge])


@pytest.mark.parametrize("seq_len,max_segments", [(1, None), (2, None), (7, 2), (64, None),
                                                  (64, 3), (257, None), (5000, None)])
@pytest.mark.parametrize("out_dtype", [np.int32, np.int64])
def test_packed_rows_equal_the_numpy_path(seq_len, max_segments, out_dtype):
    rng = np.random.default_rng(seq_len)
    lens = lengths(rng, 300, seq_len)
    tokens = rng.integers(0, 1 << 30, int(lens.sum())).astype(np.int32)
    layout = pack_documents(lens, seq_len, max_segments=max_segments)
    for trial in range(20):
        ids = rng.integers(0, layout.num_rows, 9)  # repeats allowed: a row twice in a batch
        rows = rng.permutation(12)[:9] if trial % 2 else None  # scattered destination rows
        a, b = both(lambda out: fill_packed_rows(layout, ids, tokens, out, rows),
                    batch=12 if trial % 2 else 9, seq_len=seq_len, dtype=out_dtype)
        assert_same(a, b, slice(None) if rows is None else rows)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "uint32", "int64"])
def test_every_store_dtype_it_reads(dtype):
    rng = np.random.default_rng(1)
    lens = lengths(rng, 200, 32)
    high = {"uint8": 255, "uint16": 65535}.get(dtype, 1 << 31)
    tokens = rng.integers(0, high, int(lens.sum())).astype(dtype)
    layout = pack_documents(lens, 32)
    ids = np.arange(layout.num_rows)
    a, b = both(lambda out: fill_packed_rows(layout, ids, tokens, out), batch=len(ids),
                seq_len=32)
    assert_same(a, b)


def test_a_row_of_many_tiny_documents_and_tokens_only():
    lens = np.ones(4000, np.int64)  # 1-token documents: 2049 segments a row
    tokens = np.arange(4000, dtype=np.int32)
    layout = pack_documents(lens, 2048)
    a, b = both(lambda out: fill_packed_rows(layout, np.arange(layout.num_rows), tokens, out),
                batch=layout.num_rows, seq_len=2048)
    assert_same(a, b)
    a, b = both(lambda out: fill_packed_rows(layout, np.arange(layout.num_rows), tokens, out),
                batch=layout.num_rows, seq_len=2048, masks=False)
    assert_same(a, b)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    rng = np.random.default_rng(7)
    lens = np.concatenate([rng.integers(1, 40, 3000), rng.integers(100, 700, 300)])
    rng.shuffle(lens)
    path = write_token_store(tmp_path_factory.mktemp("s") / "store",
                             rng.integers(0, 50_000, int(lens.sum())), lens, shard_tokens=9_000)
    return path


def test_the_store_loader_reads_many_shards_the_same_way(sharded):
    assert len(TokenStore(sharded).shard_token_starts) > 10  # batches cross many shards
    batches = {}
    for env in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpath, "ENABLED", env == "1")
            ld = Loader(sharded, seq_len=128, batch_size=6, layout="packed", num_workers=0)
            batches[env] = [{k: v.copy() for k, v in b.items()} for b, _ in zip(ld, range(60))]
            ld.close()
    for a, b in zip(batches["1"], batches["0"]):
        assert_same(a, b)


def test_concat_document_masks_the_same_way(sharded):
    store = TokenStore(sharded)
    rng = np.random.default_rng(3)
    starts = rng.integers(0, store.num_tokens - 130, 8)
    a, b = both(lambda o: fill_window_metadata(store, starts, 128, o, slice(0, 8)), batch=8,
                seq_len=128)
    for k in ("segment_ids", "positions", "loss_mask"):
        assert np.array_equal(a[k], b[k]), k


def test_what_it_cannot_take_goes_the_numpy_way():
    layout = pack_documents(np.array([3, 5, 2, 9]), 4)
    tokens = np.arange(19, dtype=np.int32)
    out = batch_arrays(2, 4, np.int64, True)
    strided = {k: np.empty((2, 8), v.dtype)[:, ::2] for k, v in out.items()}  # not contiguous
    assert not fastpath.packed_rows(layout, np.array([0, 1]), slice(0, 2), strided,
                                    np.array([0, 19]), lambda _: tokens)
    bad_ids = np.array([0, layout.num_rows])  # a row past the end: never read unchecked
    assert not fastpath.packed_rows(layout, bad_ids, slice(0, 2), out, np.array([0, 19]),
                                    lambda _: tokens)
    assert not fastpath.packed_rows(layout, np.array([0, 1]), np.array([0, 2]), out,
                                    np.array([0, 19]), lambda _: tokens)  # row 2 of a batch of 2
    n = layout.num_rows  # the shard ends (token 10) before the last document does: refused
    assert not fastpath.packed_rows(layout, np.arange(n), slice(0, n), batch_arrays(
        n, 4, np.int64, True), np.array([0, 10]), lambda _: tokens[:10])
    fill_packed_rows(layout, np.array([0, 1]), tokens, strided)  # and numpy fills those
    want = batch_arrays(2, 4, np.int64, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpath, "ENABLED", False)
        fill_packed_rows(layout, np.array([0, 1]), tokens, want)
    assert_same({k: np.ascontiguousarray(v) for k, v in strided.items()}, want)


def test_the_switch_turns_it_off_in_a_new_process():
    import os
    import subprocess
    import sys
    code = "from tokenmill.load import fastpath; print(fastpath.status())"
    for value, want in (("0", "numpy (TOKENMILL_FASTFILL=0)"), ("1", "compiled")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "TOKENMILL_FASTFILL": value}, check=True)
        assert r.stdout.startswith(want), r.stdout


@pytest.mark.parametrize("capacity", [1, 2, 5, 65, 2049, 8193])
def test_best_fit_places_every_item_in_the_rows_of_the_python_path(capacity):
    from tokenmill.load.pack import _best_fit  # the reference (also the fallback)
    rng = np.random.default_rng(capacity)
    for trial in range(150):
        n = int(rng.integers(0, 300))
        lengths = [rng.integers(1, capacity + 1, n), rng.integers(1, max(2, capacity // 20), n),
                   rng.choice([1, max(1, capacity // 3), capacity], n),
                   np.minimum(capacity, rng.geometric(0.01, n))][trial % 4]
        lengths = np.sort(lengths)[::-1].astype(np.int64)
        first = int(rng.integers(0, 1000))
        compiled = fastpath.best_fit(lengths, capacity, first)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpath, "ENABLED", False)
            assert np.array_equal(compiled, _best_fit(lengths, capacity, first))


def python_window(lengths, starts, docs, seq_len: int, rows: int, ordered: bool = False):
    """``PackedPlan.pack``'s arrays by the Python path (the reference and the fallback), and
    whether it cut the window as one stream (no room for a dissolved row's segments)."""
    from tokenmill.load import packfit
    from tokenmill.load.pack import pieces
    doc, off, length = pieces(lengths, seq_len)
    streamed = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpath, "ENABLED", False)
        stream = packfit._stream
        mp.setattr(packfit, "_stream", lambda *a: streamed.append(1) or stream(*a))
        item, seg_off, seg_len, row_ptr, cut = packfit.fit_rows(length, seq_len + 1, rows, None,
                                                                ordered)
    return (row_ptr, starts[doc[item]] + off[item] + seg_off, seg_len, docs[doc[item]], cut), \
        bool(streamed)


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("seq_len", [1, 2, 7, 64, 2048, 16384, 1 << 20])  # the last two: a
# sort of (key, index) pairs, far more lengths than pieces
def test_a_window_packs_into_the_rows_of_the_python_path(seq_len, ordered):
    # pieces of long documents, empty documents, every natural row count against the allotment:
    # equal rows, rows to split (by segments, then by halving the longest), and too few rows
    # (rows dissolved into the others' room, cut where nothing fits whole; were no room left,
    # the window would be cut as one stream, which only the Python path does: never seen with
    # no cap at or above the rows a stream fits, the plan's least)
    from tokenmill.load.pack import pieces, place, truncation
    from tokenmill.load.sampler import epoch_permutation
    rng = np.random.default_rng(seq_len)
    cap = seq_len + 1
    squeezed = streamed = 0
    for trial in range(160):
        n = int(rng.integers(0, 200))
        lengths = [rng.integers(0, 3 * cap, n), rng.integers(0, max(2, cap // 10), n),
                   rng.choice([0, 1, 2, cap - 1, cap, cap + 1, 2 * seq_len + 1], n),
                   np.minimum(4 * cap, rng.geometric(0.02, n))][trial % 4].astype(np.int64)
        starts = 7 + np.cumsum(lengths) - lengths  # where each document starts
        docs = rng.permutation(10 * n + 1)[:n].astype(np.int64)
        natural = len(place(pieces(lengths, seq_len)[2], cap, None, ordered)[1])
        tokens = int(lengths.sum())  # a stream cut always fits in this many rows:
        least = max(int(tokens > 0), -(-max(0, tokens - 1) // seq_len))
        fewer = {max(least, x) for x in (natural - 1, natural - int(rng.integers(2, 6)),
                                         natural * 9 // 10)}
        for rows in {natural, natural + 1, natural + int(rng.integers(2, 40)), *fewer}:
            shuffle = epoch_permutation(max(1, rows), seed=trial, epoch=rows)
            compiled = fastpath.pack_window(lengths, starts, docs, seq_len, rows, ordered=ordered,
                                            order=shuffle if trial % 2 else None)
            ref, stream = python_window(lengths, starts, docs, seq_len, rows, ordered)
            if stream:
                streamed += 1
                assert compiled is None
                continue
            squeezed += rows < natural
            assert compiled is not None and len(compiled[0]) == rows + 1
            for got, want in zip(compiled, ref):
                assert np.array_equal(got, want), (trial, rows, natural)
            assert compiled[5:7] == truncation(lengths, seq_len)
            if trial % 2:  # the rows' order, made in the same pass: the sampler's permutation
                assert np.array_equal(compiled[7], shuffle(np.arange(rows)))
            else:
                assert compiled[7] is None
    assert squeezed > 40 if seq_len >= 64 else True  # short rows are full: nothing to squeeze



@pytest.mark.parametrize("seq_len,packing", [(64, "strata-v1"), (512, "strata-ordered-v2")])
def test_a_plan_packs_the_same_windows_either_way(tmp_path, seq_len, packing):
    lens = np.array([1 + i * 7 % 37 + (300 if i % 97 == 0 else 0) for i in range(3000)])
    store = write_token_store(tmp_path / "s", np.arange(int(lens.sum())) % 1000, lens)
    layouts = {}
    for on in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpath, "ENABLED", on)
            with Loader(store, seq_len=seq_len, batch_size=4, layout="packed") as loader:
                assert loader.describe()["packing"] == packing
                layouts[on] = [{k: a.copy() for k, a in loader.batch_at(4 * k).items()}
                               for k in range(0, 200, 7)]
    for a, b in zip(layouts[True], layouts[False]):
        assert_same(a, b)


@pytest.mark.parametrize("docs,run,strata", [(1, 1, 1), (10, 1, 3), (1000, 1, 7),
                                             (1000, 41, 6), (997, 41, 5), (50, 7, 8)])
def test_a_window_s_documents_are_those_of_the_python_path(docs, run, strata):
    # strata of unequal sizes (the last windows hold fewer strata: a merged last), a shorter
    # last run, every shift and window index, and indices past the last window (no documents)
    from tokenmill.load.packplan import PackedPlan
    rng = np.random.default_rng(docs + run)
    units = -(-docs // run)
    strata = min(strata, units)
    plan = PackedPlan.__new__(PackedPlan)
    plan.num_docs, plan.run, plan.strata = docs, run, strata
    plan.bounds = np.arange(strata + 1, dtype=np.int64) * units // strata
    plan.sizes = np.diff(plan.bounds)
    for trial in range(20):
        shift = rng.integers(0, 1 << 40, strata) % plan.sizes
        plan._shift = lambda epoch: shift
        xs = sorted(rng.choice(int(plan.sizes.max()) + 2, min(4, int(plan.sizes.max()) + 2),
                               replace=False).tolist())
        ids, offsets = fastpath.window_ids(plan.bounds, shift, xs, run, docs)
        want = [plan._ids(0, x) for x in xs]
        assert offsets.tolist() == [0, *np.cumsum([len(w) for w in want]).tolist()]
        assert np.array_equal(ids, np.concatenate(want))


@pytest.mark.parametrize("capacity", [1, 2, 5, 65, 2049])
def test_open_fit_places_every_item_in_the_rows_of_the_python_path(capacity):
    from tokenmill.load.pack import OPEN_ROWS, _open_fit  # the reference (also the fallback)
    assert fastpath.fastpack.OPEN_ROWS == OPEN_ROWS
    rng = np.random.default_rng(capacity)
    for trial in range(100):
        n = int(rng.integers(0, 400))
        lengths = [rng.integers(1, capacity + 1, n), rng.integers(1, max(2, capacity // 20), n),
                   np.minimum(capacity, rng.geometric(0.05, n))][trial % 3].astype(np.int64)
        compiled = fastpath.open_fit(lengths, capacity)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpath, "ENABLED", False)
            assert np.array_equal(compiled, _open_fit(lengths, capacity))


def test_best_fit_refuses_what_it_cannot_place():
    assert fastpath.best_fit(np.array([7, 3]), 6, 0) is None  # longer than a row
    assert fastpath.best_fit(np.array([5, 0]), 6, 0) is None  # empty


def test_a_batch_over_more_shards_than_a_call_holds_is_filled_a_group_at_a_time(sharded):
    # GROUP shards are held mapped a call; 2 makes every batch of this store take several calls
    store = TokenStore(sharded)
    layout = pack_documents(store.doc_lengths, 128)
    ids = np.random.default_rng(2).integers(0, layout.num_rows, 12)
    from tokenmill.load import fastfill
    bounds = np.asarray(store.shard_token_starts, np.int64)
    assert len(fastfill.shards_of(layout.row_ptr, layout.seg_start, ids, bounds)) > 4

    def fill(out):
        if fastpath.ENABLED:
            assert fastpath.packed_rows(layout, ids, slice(0, 12), out, bounds, store.shard)
        else:
            fill_packed_rows(layout, ids, store.tokens, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpath, "GROUP", 2)
        a, b = both(fill, batch=12, seq_len=128)
    assert_same(a, b)


OUT_SHAPES = '''
import sys
import numpy as np
from tokenmill.load import fastpath
from tokenmill.load.pack import pack_documents
from tokenmill.load.plan import batch_arrays
layout = pack_documents(np.full(40, 5), 8)
tokens = np.arange(200, dtype=np.int32)
wide, narrow = sys.argv[1], sys.argv[2]
out = batch_arrays(4, 8, np.int64, True)
out[wide] = np.zeros((4, 65536), out[wide].dtype)  # wider than the batch's rows
out[narrow] = np.zeros((4, 1), out[narrow].dtype)
ok = fastpath.packed_rows(layout, np.arange(4), slice(0, 4), out, np.array([0, 200]),
                          lambda _: tokens)
meta = fastpath.metadata_rows(np.array([0, 1, 2, 3, 4]), np.full(4, 5), slice(0, 4), out)
print(ok, meta)
'''


@pytest.mark.parametrize("wide,narrow", [("segment_ids", "positions"), ("loss_mask", "inputs"),
                                         ("positions", "loss_mask")])
def test_arrays_of_other_widths_are_refused_not_written_past(tmp_path, wide, narrow):
    import subprocess
    import sys
    # a process of its own: writing past an array shows as a crash (SIGSEGV, SIGABRT)
    script = tmp_path / "shapes.py"
    script.write_text(OUT_SHAPES)
    r = subprocess.run([sys.executable, str(script), wide, narrow], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], (r.returncode, r.stderr)


def test_layouts_it_cannot_trust_are_refused():
    from tokenmill.load import fastfill
    out = batch_arrays(1, 8, np.int64, True)
    tokens = np.arange(50, dtype=np.int32)
    args = (np.array([0], np.int64), np.array([0, 50], np.int64), np.array([0], np.int64),
            [tokens], out["inputs"], out["targets"], out["segment_ids"], out["positions"],
            out["loss_mask"])
    bad = [  # (row_ptr, seg_start, seg_len): a negative length, a row past the segments
        (np.array([0, 2]), np.array([0, 5]), np.array([4, -3])),
        (np.array([0, 3]), np.array([0, 5]), np.array([4, 3])),
        (np.array([-1, 1]), np.array([0, 5]), np.array([4, 3])),
    ]
    for row_ptr, seg_start, seg_len in bad:
        assert not fastfill.fill_packed(row_ptr, seg_start, seg_len, np.array([0]), *args)
        assert not fastfill.fill_metadata_rows(row_ptr, seg_len, np.array([0]), np.array([0]),
                                               out["segment_ids"], out["positions"],
                                               out["loss_mask"])


MANY_SHARDS = '''
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from tokenmill import Loader
peak = 0
with Loader(sys.argv[1], seq_len=256, batch_size=8, layout="packed", num_workers=0) as ld:
    for _, batch in zip(range(40), ld):
        peak = max(peak, len(os.listdir("/proc/self/fd")))
print(peak)
'''


def test_a_packed_batch_over_hundreds_of_shards_holds_a_bounded_number_of_descriptors(tmp_path):
    import subprocess
    import sys
    # 1-3 token documents, ~40 a shard: a batch's rows draw from ~90 shards. With 64
    # descriptors allowed (max_open 32), holding every shard of a batch mapped at once ran out
    # of descriptors (EMFILE, a raw traceback); a group of 16 at a time stays within them
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 4, 24_000)
    store = write_token_store(tmp_path / "s", np.arange(int(lengths.sum())) % 50_000, lengths,
                              shard_tokens=80)
    script = tmp_path / "many.py"
    script.write_text(MANY_SHARDS)
    r = subprocess.run([sys.executable, str(script), str(store)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) <= 32 + 16, r.stdout  # between batches: max_open maps and the rest


def test_a_compiled_build_older_than_the_code_is_left_out_and_said(tmp_path):
    # an editable install updated without a rebuild keeps the older .so files: a fastpack
    # without pack_window / open_fit must not crash the Loader (AttributeError) but take the
    # numpy path, the same batches, status() saying to rebuild
    import os
    import subprocess
    import sys
    lengths = np.random.default_rng(4).integers(1, 40, 3000)
    store = write_token_store(tmp_path / "s", np.arange(int(lengths.sum())) % 1000, lengths)
    code = ("import importlib.util, sys, types, numpy as np\n"  # the .so, before tokenmill
            "spec = importlib.util.spec_from_file_location('tokenmill.load.fastpack', "
            f"{fastpath.fastpack.__file__!r})\n"
            "new = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(new)\n"
            "old = types.ModuleType(new.__name__)\n"  # the build before open_fit existed
            "old.__dict__.update({k: v for k, v in vars(new).items() if k not in "
            "('open_fit', 'pack_window', 'work_size', 'OPEN_ROWS')})\n"
            "sys.modules[new.__name__] = old\n"
            "from tokenmill.load import fastpath\n"
            "assert fastpath.fastpack is old\n"
            "from tokenmill import Loader\n"
            "print(fastpath.status())\n"
            f"with Loader({str(store)!r}, seq_len=1024, batch_size=4, layout='packed') as ld:\n"
            "    b = ld.batch_at(8)\n"
            "    print(int(np.asarray(b['inputs'], np.int64).sum()), "
            "int(b['segment_ids'].sum()))\n")
    out = {}
    for env in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "TOKENMILL_FASTFILL": env})
        assert r.returncode == 0, r.stderr[-2000:]
        out[env] = r.stdout.splitlines()
    assert out["1"][0].startswith("numpy (the compiled row filler is older than this tokenmill")
    assert "pip install -e ." in out["1"][0]
    assert out["1"][1] == out["0"][1]


def test_the_work_kept_between_windows_is_bounded():
    # a window of book-length documents in rows of 128 tokens is 500,000 pieces: its work array
    # (84 MiB) is not kept for the process's life; a window of paragraphs' (6 MiB) is, and reused
    fastpath._SPARE.clear()
    books = np.full(64, 1_000_000, np.int64)
    starts = np.cumsum(books) - books
    rows = len(pieces_of(books, 128))
    assert fastpath.pack_window(books, starts, np.arange(64), 128, rows) is not None
    assert sum(a.nbytes for a in fastpath._SPARE) <= 16 << 20
    paragraphs = np.random.default_rng(0).integers(1, 60, 65_536)
    starts = np.cumsum(paragraphs) - paragraphs
    for _ in range(2):
        got = fastpath.pack_window(paragraphs, starts, np.arange(65_536), 2048, 2000, ordered=True)
        assert got is not None and len(fastpath._SPARE) == 1
    kept = fastpath._SPARE[0]
    fastpath.pack_window(paragraphs, starts, np.arange(65_536), 2048, 2000, ordered=True)
    assert len(fastpath._SPARE) == 1 and fastpath._SPARE[0] is kept  # reused: no fresh pages


def test_a_window_s_arrays_are_freed_with_their_last_view():
    # pack_window's outputs are malloc'd without the GIL and owned by the arrays over them: 400
    # windows of 65,536 paragraphs (1.6 MiB of outputs each) leave the process no bigger than a
    # few windows would; and a view kept past its array still reads the window's values
    import resource
    paragraphs = np.random.default_rng(0).integers(1, 60, 65_536)
    starts = np.cumsum(paragraphs) - paragraphs
    first = fastpath.pack_window(paragraphs, starts, np.arange(65_536), 2048, 2000, ordered=True)
    view, want = first[1][5:9], first[1][5:9].copy()
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(400):
        got = fastpath.pack_window(paragraphs, starts, np.arange(65_536), 2048, 2000,
                                   ordered=True)
        assert got is not None and got[1].flags.writeable
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 100, grown_mib  # 400 windows leaked would be > 600 MiB
    assert np.array_equal(view, want)


def pieces_of(lengths, seq_len: int):
    """``pack.pieces``' lengths."""
    from tokenmill.load.pack import pieces
    return pieces(lengths, seq_len)[2]
