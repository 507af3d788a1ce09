"""The lazily packed layout on stores at the edges: rows that hold nothing (a window of empty
documents, or more rows allotted than its documents can fill) are padding, never a crash, and
every (input, target) pair is still in exactly one row an epoch."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from conftest import take, write_positional_store

from tokenmill import Loader
from tokenmill.load import pack
from tokenmill.load.packfit import fit_rows
from tokenmill.load.packplan import PackedPlan
from tokenmill.store import TokenStore


def epoch_rows(loader) -> dict[str, np.ndarray]:
    """The rows of the loader's first epoch, in order (the batches' rows, cut at the epoch)."""
    n = loader.samples_per_epoch
    batches = take(loader, -(-n // loader.batch_size))
    return {k: np.concatenate([b[k] for b in batches])[:n] for k in batches[0]}


def pairs_of(rows: dict[str, np.ndarray]) -> np.ndarray:
    """The (input, target) pairs the rows train on, as their inputs (a positional store: the
    target of input t is t + 1), sorted."""
    mask = rows["loss_mask"].astype(bool)
    assert np.array_equal(rows["targets"][mask], rows["inputs"][mask] + 1)
    return np.sort(rows["inputs"][mask].astype(np.int64))


def store_pairs(lengths: np.ndarray, offset: int) -> np.ndarray:
    starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.concatenate([np.arange(s, s + n - 1) for s, n in zip(starts, lengths) if n > 1])


def test_one_token_documents_one_a_row_give_an_epoch_of_rows(tmp_path):
    # max_segments=1: more rows allotted than the documents fill, and a one-token document
    # cannot be split: the window's last rows are empty
    path = write_positional_store(tmp_path / "s", np.ones(700, np.int64), offset=1)
    with Loader(path, seq_len=4, batch_size=4, layout="packed", num_workers=0,
                max_segments=1) as ld:
        rows = epoch_rows(ld)
    assert not rows["loss_mask"].any()  # a one-token document has no pair
    buf = np.concatenate([rows["inputs"], rows["targets"][:, -1:]], axis=1)
    assert np.array_equal(np.sort(buf[buf > 0]), np.arange(1, 701))  # every token once


def test_a_store_mostly_of_empty_documents_gives_every_pair_once(tmp_path):
    # windows of K documents, one from each stratum: those missing the 3 documents with tokens
    # hold no segment, yet are allotted a row
    lengths = np.zeros(32_768, np.int64)
    lengths[[5, 16_000, 32_760]] = [700, 600, 500]
    path = write_positional_store(tmp_path / "s", lengths, offset=1)
    with Loader(path, seq_len=1, batch_size=2, layout="packed", num_workers=0) as ld:
        plan = ld.plan.sources[0].packed
        n = plan.num_windows()
        assert n >= 4
        assert min(plan.window_rows(0, w).layout.seg_len.size for w in range(n)) == 0
        rows = epoch_rows(ld)
        assert len(ld.explain(0)) == 2
    assert np.array_equal(pairs_of(rows), store_pairs(lengths, 1))


def python_calls(f) -> int:
    """Python and C function calls made while ``f()`` runs (sys.setprofile: no clock)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")
    sys.setprofile(count)
    try:
        f()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("cap", [1, 2])
def test_rows_beyond_the_packing_cost_work_linear_in_segments(cap):
    # 300 rows more than packing fills: each found by a heap, not a pass over every row
    length = np.random.default_rng(0).integers(1, 5, 20_000)
    rows = len(pack.place(length, 65, cap)[1]) + 300
    out = []
    calls = python_calls(lambda: out.append(fit_rows(length, 65, rows, cap)))
    assert len(out[0][3]) == rows + 1
    assert calls < 16 * len(length), calls  # was 3.1 M (cap 2), 12 M (cap 1): segments × rows


class CountingPasses:
    """A TokenStore that counts its ``doc_spans`` calls from the thread that made it: passes
    over the shards' indexes that a batch waits for (packing ahead runs in another thread)."""

    def __init__(self, store: TokenStore):
        self.store, self.passes, self.thread = store, 0, threading.get_ident()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def __len__(self):
        return len(self.store)

    def doc_spans(self, ids):
        self.passes += threading.get_ident() == self.thread
        return self.store.doc_spans(ids)


@pytest.mark.parametrize("where", [0.1, 0.5, 0.93])
def test_a_resume_deep_in_an_epoch_reads_the_indexes_in_two_passes(tmp_path, where):
    # the strata's first documents with the first probe, then the block of windows the resumed
    # rows are packed from, whose prefix sums give the windows after (was 5 passes)
    lengths = np.random.default_rng(1).integers(0, 700, 13_000)
    path = write_positional_store(tmp_path / "s", lengths, shard_tokens=90_000)
    with TokenStore(path) as store:
        counting = CountingPasses(store)
        plan = PackedPlan(counting, seq_len=8, max_segments=None, seed=0, salt=0)
        assert plan.num_windows() > 8 * plan.block
        counting.passes = 0
        j = int(plan.num_rows * (5 + where))
        plan.locate(np.arange(j, j + 4096))  # a block of positions, as the Loader's
        assert counting.passes == 2


FORK_SCRIPT = """
import hashlib, os, sys, threading, time
import numpy as np
from tokenmill import Loader
from tokenmill.load.packplan import PackedPlan
from tokenmill.store import TokenStore

# the pack-ahead thread is inside this (packing a window, or mapping a shard's index under the
# store's lock for that shard) when the process forks
owner, name = {"pack": (PackedPlan, "pack"), "index": (TokenStore, "_read_index")}[sys.argv[2]]
inside, real = threading.Event(), getattr(owner, name)
def slow(self, *args, **kw):
    if threading.current_thread().name == "tokenmill-pack-ahead" and not inside.is_set():
        inside.set()
        time.sleep(1.0)
    return real(self, *args, **kw)
setattr(owner, name, slow)

def digest(loader, steps):
    h = hashlib.sha256()
    for k in range(steps):
        for a in loader.batch_at(k * 8).values():
            h.update(a.tobytes())
    return h.hexdigest()

# max_open 2: a store of many shards maps their indexes again and again, on either thread
ld = Loader(TokenStore(sys.argv[1], max_open=2), seq_len=16, batch_size=8, layout="packed",
            num_workers=0)
plan = ld.plan.sources[0].packed
steps = 3 * plan.num_rows // 8  # three epochs: every window of each, packed in the child
k = 0
while not inside.wait(0.05 if k == 1 else 0):  # window 1 handed to the pack-ahead thread at
    assert k < steps, "the pack-ahead thread never got there"  # step 0, others later
    ld.batch_at(k * 8)
    k += 1
pid = os.fork()
if pid == 0:
    print("child", digest(ld, steps), flush=True)
    os._exit(0)
print("parent", digest(ld, steps), flush=True)
deadline = time.monotonic() + 60
while os.waitpid(pid, os.WNOHANG) == (0, 0):  # a hung child is killed, not left behind
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        sys.exit("the forked child hung")
    time.sleep(0.05)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="os.fork: POSIX only")
@pytest.mark.parametrize("inside", ["pack", "index"])
def test_a_fork_while_a_window_is_packed_ahead_packs_it_again_in_the_child(tmp_path, inside):
    # the child has none of the parent's threads: the window they were packing (a pending
    # future, the plan's lock), the jobs queued for them and the store locks they held were the
    # parent's; the child packs them itself and gives the parent's batches (it used to wait
    # forever for that window, or for a shard's index the parent's thread was mapping)
    import subprocess
    lengths = np.random.default_rng(3).integers(1, 40, 20_000)
    path = write_positional_store(tmp_path / "s", lengths, shard_tokens=25_000)
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(path), inside], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got["child"] == got["parent"]
