"""Streaming mode: batches equal a reference built from the documents, workers, ranks, resume in
fresh processes (also after a crash), the cache store equals prepare's, errors and lifetime."""

import fcntl
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (assert_resumes_exactly, assert_worker_death_is_an_error, stdlib_texts,
                      store_bytes, take, write_jsonl)
from tokenmill import Loader, Meter, prepare, verify_store
from tokenmill.base.errors import ConfigError, InputError, StaleIterator
from tokenmill.load.pack import concat_offset
from tokenmill.prepare.pool import UNITS_PER_WORKER
from tokenmill.load.sampler import hash_ints
from tokenmill.store.writer import LOCK, PROGRESS
from tokenmill.streaming import DELAY_TAG, emission_order, emission_time, emitted_before
from tokenmill.streaming.producer import READY_BATCHES

L, B, S = 32, 4, 24
OPTS = dict(unit_bytes=3000, shard_tokens=20_000)  # many units, several shards


def paragraphs(limit_bytes):
    """Real text cut at blank lines: documents of 1 to a few hundred bytes, in a fixed order."""
    docs = []
    for t in stdlib_texts(limit_bytes):
        docs += [p for p in t.split("\n\n") if p.strip()]
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files of real paragraphs; the documents in the order the sources read them."""
    root = tmp_path_factory.mktemp("text")
    docs = paragraphs(110_000)
    half = len(docs) // 2
    write_jsonl(root / "a.jsonl", docs[:half])
    write_jsonl(root / "b.jsonl", docs[half:])
    return root, docs


def stream_tokens(docs):
    """What the bytes tokenizer makes of the documents: UTF-8 bytes, EOS (256) after each."""
    return np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int32), 256)
                           for d in docs])


def reference_order(n, seed, shuffle_buffer):
    """The documented order: window i leaves at i + hash(DELAY_TAG, seed, i) mod min(S, i + 1),
    ties by i."""
    i = np.arange(n, dtype=np.int64)
    t = i + (hash_ints(DELAY_TAG, seed, i) % np.minimum(i + 1, shuffle_buffer).astype(np.uint64)
             ).astype(np.int64)
    return i[np.lexsort((i, t))]


class Reference:
    """Batches computed from the documents alone (epoch 0) and from the store (later epochs)."""

    def __init__(self, docs, *, seed=0, batch_size=B, world_size=1, shuffle_buffer=S):
        self.tokens = stream_tokens(docs)
        self.n = (len(self.tokens) - L) // L
        self.order = reference_order(self.n, seed, shuffle_buffer)
        self.offset = concat_offset(L, seed=seed, epoch=0)
        self.seed, self.B, self.W = seed, batch_size, world_size

    def batch(self, step, rank=0, store=None):
        k = step * self.B * self.W
        rows = []
        for p in range(k + rank * self.B, k + (rank + 1) * self.B):
            if p < self.n:
                s = self.offset + int(self.order[p]) * L
                rows.append(self.tokens[s:s + L + 1])
            else:
                assert store is not None, "past the pass: needs the store"
                with Loader(store, seq_len=L, batch_size=1, seed=self.seed, rank=0,
                            world_size=1) as ld:
                    b = ld.batch_at(p)
                rows.append(np.append(b["inputs"][0], b["targets"][0][-1]))
        rows = np.stack(rows)
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def assert_batches(got, ref, first_step=0, rank=0, store=None):
    for j, b in enumerate(got):
        want = ref.batch(first_step + j, rank, store)
        assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (ref.B, L)
        for key in ("inputs", "targets"):
            assert np.array_equal(b[key], want[key]), f"step {first_step + j}, rank {rank}: {key}"


def make(corpus, cache, **kw):
    root, _ = corpus
    args = dict(seq_len=L, batch_size=B, cache_dir=cache, seed=0, rank=0, world_size=1,
                num_workers=0, shuffle_buffer=S, **OPTS)
    args.update(kw)
    return Loader.from_text([str(root)], **args)


def children(exclude=()):
    """Live child processes of this one (leftovers of other tests passed as ``exclude``)."""
    import psutil
    found = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid not in exclude and c.status() != psutil.STATUS_ZOMBIE and \
                    "resource_tracker" not in " ".join(c.cmdline()):
                found.append(c)
        except psutil.Error:  # ended meanwhile
            pass
    return found


def pids():
    return {c.pid for c in children()}


# ---- the order ----------------------------------------------------------------------------------

def test_golden_pass_order_seed_0():
    # Only update if you mean to break users' reproducibility: the pass order for seed 0, S = 8.
    order, times = emission_order(0, 20, seed=0, shuffle_buffer=8)
    assert order[:16].tolist() == [0, 1, 2, 3, 4, 5, 6, 12, 7, 11, 8, 9, 10, 14, 13, 15]
    assert times[:16].tolist() == [0, 1, 2, 4, 5, 6, 8, 13, 14, 14, 15, 15, 15, 15, 17, 17]


@pytest.mark.parametrize("n", [None, 50])
def test_emission_time_inverts_the_order(n):
    order, times = emission_order(0, 200, seed=3, shuffle_buffer=9, num_windows=n)
    total = len(order) if n is None else n
    assert n is None or sorted(order.tolist()) == list(range(n))  # a permutation of the pass
    assert (np.abs(order - np.arange(len(order)))[:total - 9] < 9).all()  # moved < S places
    for k in range(0, total if n else 150):
        t = emission_time(k, seed=3, shuffle_buffer=9, num_windows=n)
        assert t == times[k]
        assert emitted_before(t, seed=3, shuffle_buffer=9, num_windows=n) <= k


# ---- batches ------------------------------------------------------------------------------------

def test_pass_equals_the_reference_then_the_store_and_the_cache_equals_prepare(corpus, tmp_path):
    root, docs = corpus
    ref = Reference(docs)
    with make(corpus, tmp_path / "cache", num_workers=2) as ld:
        assert ld.num_workers == 2
        steps = ref.n // B + 3  # the whole pass, a batch across its end, and two of epoch 1
        got = take(ld, steps)
        store = ld.store_path
        assert ld.pass_samples == ref.n and len(ld) == ref.n // B
        assert ld.stage_times()["tokenization"] > 0
    assert verify_store(store) == []
    assert_batches(got[:ref.n // B], ref)
    assert_batches(got[ref.n // B:], ref, first_step=ref.n // B, store=store)
    prepared = prepare([str(root)], out=tmp_path / "prepared", tokenizer="bytes", workers=1,
                       progress=False, **OPTS)
    assert len(prepared["shards"]) > 1
    assert store_bytes(store) == store_bytes(tmp_path / "prepared")


def test_same_batches_for_any_worker_count_and_from_a_complete_cache(corpus, tmp_path):
    _, docs = corpus
    ref = Reference(docs, seed=5)
    runs = {}
    for w in (0, 1, 3):
        with make(corpus, tmp_path / f"cache{w}", num_workers=w, seed=5) as ld:
            runs[w] = take(ld, 120)
    assert_batches(runs[0], ref)
    for w in (1, 3):
        assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(runs[0], runs[w]))
    with make(corpus, tmp_path / "cache0", seed=5) as ld:  # cache complete? not yet: 120 steps
        assert not (ld.store_path / "manifest.json").exists()
        take(ld, ref.n // B + 1)
        assert (ld.store_path / "manifest.json").exists()
    before = pids()
    with make(corpus, tmp_path / "cache0", seed=5, num_workers=2) as ld:  # epoch 0 from the store
        assert_batches(take(ld, 50), ref)
        assert ld.stage_times()["tokenization"] == 0 and children(before) == []


def test_two_ranks_take_disjoint_slices_of_the_global_batch(corpus, tmp_path):
    _, docs = corpus
    ref = Reference(docs, batch_size=B, world_size=2)
    cache = tmp_path / "shared"  # one cache: one of the two writes it, the other waits for it
    with make(corpus, cache, rank=0, world_size=2) as r0, \
            make(corpus, cache, rank=1, world_size=2) as r1:
        steps = ref.n // (2 * B) + 2
        got = [take(r0, steps), take(r1, steps)]
        store = r0.store_path
    windows = [[], []]
    for rank in (0, 1):
        assert_batches(got[rank], ref, rank=rank, store=store)
        for step in range(ref.n // (2 * B)):  # rank r holds positions [k + rB, k + (r+1)B)
            k = step * 2 * B + rank * B
            windows[rank] += ref.order[k:k + B].tolist()
    assert not set(windows[0]) & set(windows[1])
    assert sorted(windows[0] + windows[1]) == sorted(ref.order[:ref.n // (2 * B) * 2 * B].tolist())
    assert verify_store(store) == []


def test_shuffle_buffer_memory_is_bounded(corpus, tmp_path):
    root, _ = corpus
    with make(corpus, tmp_path / "c", shuffle_buffer=64) as ld:
        take(ld, 200)
    longest = max(len(line) for f in root.glob("*.jsonl") for line in f.read_bytes().split(b"\n"))
    delta = max(B, 64 // 4)
    bound = (64 + 2 * delta + 2) * L + 2 * (OPTS["unit_bytes"] + longest)
    assert 0 < ld.buffer_peak_tokens <= bound
    assert ld.buffer_bytes() >= ((64 + 2 * delta + 2) * L + 2 * OPTS["unit_bytes"]) * 2  # uint16


# ---- resume -------------------------------------------------------------------------------------

RESUME = """
import fcntl, json, os, sys
from tokenmill import Loader
jobs = json.loads(sys.argv[1])
out = []
for job in jobs:
    fd = None
    if job["locked"]:  # another process writes this cache: reading must start from resume_from
        fd = os.open(job["lock"], os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
    ld = Loader.from_text([job["root"]], seq_len={L}, batch_size={B}, cache_dir=job["cache"],
                          seed=2, rank=0, world_size=1, num_workers=1, shuffle_buffer={S},
                          unit_bytes={unit_bytes}, shard_tokens={shard_tokens})
    ld.load_state_dict(job["state"])
    out.append([b["inputs"].tolist() for _, b in zip(range(job["steps"]), ld)])
    ld.close()
    if fd is not None:
        os.close(fd)
print(json.dumps(out))
"""


def run_resume(jobs):
    code = RESUME.format(L=L, B=B, S=S, **OPTS)
    res = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_resume_is_exact_in_a_fresh_process(corpus, tmp_path):
    root, docs = corpus
    ref = Reference(docs, seed=2)
    end = ref.n // B  # the first step that reaches past the pass
    marks = [0, 1, 37, end // 2, end - 6, end - 1, end + 1]
    cache = tmp_path / "cache"
    states = {}
    with make(corpus, cache, seed=2, num_workers=1) as ld:
        for step in range(end + 2):
            if step in marks:
                states[step] = json.loads(json.dumps(ld.state_dict()))
            next(iter(ld))  # a new iterator every step: nothing taken ahead is lost
        store = ld.store_path
    assert set(states[37]) == {"version", "mode", "fingerprint", "consumed_samples",
                               "pass_samples", "resume_from", "settings"}
    assert states[37]["settings"] == {"seq_len": L, "seed": 2, "shuffle_buffer": S,
                                      "layout": "concat", "max_segments": None,
                                      "pack_window": 1024}
    assert states[37]["resume_from"] is not None and states[37]["pass_samples"] is None
    assert states[end + 1]["pass_samples"] == ref.n
    jobs = []
    for m in (0, 37, end - 1, end + 1):  # an empty cache: reads (and writes) from the start
        jobs.append(dict(state=states[m], steps=4, cache=str(tmp_path / f"fresh{m}"), locked=False,
                         root=str(root), lock=""))
    for m in (1, end // 2, end - 6):  # another process writes the cache: replay from resume_from
        other = tmp_path / f"other{m}"
        (other / store.name).mkdir(parents=True)
        jobs.append(dict(state=states[m], steps=4, cache=str(other), locked=True, root=str(root),
                         lock=str(other / store.name / LOCK)))
    for m in (37, end - 6):  # the complete cache: epoch 0 read back from the store
        jobs.append(dict(state=states[m], steps=4, cache=str(cache), locked=False, root=str(root),
                         lock=""))
    for job, got in zip(jobs, run_resume(jobs)):
        step = job["state"]["consumed_samples"] // B
        assert len(got) == 4
        for j, rows in enumerate(got):
            want = ref.batch(step + j, store=store)["inputs"]
            assert np.array_equal(np.array(rows), want), f"resume at {step} ({job['cache']}), +{j}"


def test_resume_at_every_step_equals_the_uninterrupted_stream(corpus, tmp_path):
    # one cache that grows as the loaders run: each also resumes the writing of the one before
    assert_resumes_exactly(lambda: make(corpus, tmp_path / "c", num_workers=0), steps=12)


def test_a_crashed_pass_resumes_its_batches_and_its_cache(corpus, tmp_path):
    root, docs = corpus
    ref = Reference(docs)
    cache, state_file = tmp_path / "cache", tmp_path / "state.json"
    code = textwrap.dedent(f"""
        import json, os, signal
        from tokenmill import Loader
        ld = Loader.from_text([{str(root)!r}], seq_len={L}, batch_size={B},
                              cache_dir={str(cache)!r}, seed=0, rank=0, world_size=1,
                              num_workers=1, shuffle_buffer={S},
                              unit_bytes={OPTS['unit_bytes']}, shard_tokens=4000)
        it = iter(ld)
        for step in range(400):
            next(it)
            if step == 250:
                json.dump(ld.state_dict(), open({str(state_file)!r}, "w"))
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind
    """)
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -signal.SIGKILL
    store = next(p for p in cache.iterdir() if p.is_dir())
    assert len(list((store / PROGRESS).glob("shard-*.json"))) >= 2  # committed before the crash
    with make(corpus, cache, num_workers=1, **{"shard_tokens": 4000}) as ld:
        ld.load_state_dict(json.load(open(state_file)))
        got = take(ld, ref.n // B - 251 + 2)
    assert_batches(got, ref, first_step=251, store=store)
    prepare([str(root)], out=tmp_path / "prepared", tokenizer="bytes", workers=1, progress=False,
            unit_bytes=OPTS["unit_bytes"], shard_tokens=4000)
    assert store_bytes(store) == store_bytes(tmp_path / "prepared")


def test_state_is_refused_for_other_settings(corpus, tmp_path):
    with make(corpus, tmp_path / "c", seed=0) as a, make(corpus, tmp_path / "c", seed=1) as b:
        take(a, 3)
        with pytest.raises(ConfigError, match="fingerprint"):
            b.load_state_dict(a.state_dict())
        with pytest.raises(ConfigError, match="version"):
            b.load_state_dict({"version": 1, "consumed_samples": 0, "fingerprint": "x"})
    for kw, match in [({"shuffle_buffer": 0}, "shuffle_buffer"), ({"cache_dir": None}, "cache_dir"),
                      ({"num_workers": -1}, "num_workers"), ({"batch_size": 0}, "batch_size")]:
        with pytest.raises(ConfigError, match=match):
            make(corpus, tmp_path / "c", **kw)


# ---- errors and lifetime ------------------------------------------------------------------------

def test_a_bad_line_surfaces_with_file_and_line(corpus, tmp_path):
    _, docs = corpus
    root = tmp_path / "bad"
    root.mkdir()
    write_jsonl(root / "a.jsonl", docs[:300])
    lines = [json.dumps({"text": d}) for d in docs[300:400]]
    lines[56] = '{"text": "unterminated'
    (root / "b.jsonl").write_text("\n".join(lines) + "\n")
    before = pids()
    with make((root, None), tmp_path / "c", num_workers=2) as ld:
        with pytest.raises(InputError, match=r"b\.jsonl:57"):
            take(ld, 10_000)
        with pytest.raises(InputError):  # and again, not a hang or a silent end
            next(iter(ld))
    assert children(before) == []


def test_a_dead_worker_is_an_error_not_a_hang_with_advice_that_fits(corpus, tmp_path):
    before = pids()
    root, _ = corpus
    longest = max(len(line) for f in root.glob("*.jsonl") for line in f.read_bytes().split(b"\n"))
    with make(corpus, tmp_path / "c", num_workers=1, unit_bytes=500) as ld:
        it = iter(ld)
        next(it)
        workers = children(before)
        assert len(workers) == 1
        # the batches made before the kill, at most: those ready, and those the tokens it may
        # hold could make (its own bound, buffer_bytes, in uint16, and a line more a unit)
        held = ld.buffer_bytes() // 2 + (UNITS_PER_WORKER + 3) * longest
        error = assert_worker_death_is_an_error(it, workers,
                                                budget=READY_BATCHES + held // (B * L) + 1)
    text = str(error)
    assert "a streaming worker died" in text and "killed by SIGKILL" in text, text
    # prepare's advice is wrong here: there is no command to run again
    assert "run the same command again" not in text and "--workers" not in text, text
    assert "create it again (it resumes from its state_dict)" in text, text


def test_nothing_left_after_close_or_gc(corpus, tmp_path):
    before, others = set(threading.enumerate()), pids()
    ld = make(corpus, tmp_path / "c", num_workers=2)
    take(ld, 5)
    assert len(children(others)) == 2
    ld.close()
    ld.close()  # idempotent
    ld = make(corpus, tmp_path / "c", num_workers=2)
    take(ld, 5)
    del ld
    gc.collect()
    deadline = time.monotonic() + 60  # a hang guard only (5 s: a busy machine can be slower)
    while time.monotonic() < deadline and (set(threading.enumerate()) - before or
                                           children(others)):
        time.sleep(0.05)
    assert set(threading.enumerate()) - before == set()
    assert children(others) == []


def test_the_meter_sees_the_tokenization_stage(corpus, tmp_path):
    with make(corpus, tmp_path / "c", num_workers=1) as ld:
        meter = Meter(ld)
        for _, _b in zip(range(300), meter):
            pass
        s = meter.summary()
    assert set(s["stage_s"]) == {"tokenization", "write", "assemble"}
    assert s["stage_s"]["tokenization"] > 0


# ---- a script as users write it, and states that contradict themselves (issue 12: 15, 7) --------

SCRIPT = """\
import json, sys
import tokenmill

loader = tokenmill.Loader.from_text([{root!r}], tokenizer="bytes", seq_len={L}, batch_size={B},
                                    cache_dir={cache!r}, num_workers=2, shuffle_buffer={S},
                                    unit_bytes={unit_bytes}, shard_tokens={shard_tokens})
batches = []
for step, batch in enumerate(loader):
    batches.append(batch["inputs"].tolist())
    if step == 5:
        break
loader.close()
print(json.dumps(batches))
"""


def run_script(path, *args):
    """Run a script file the way a user does (``python script.py``), in a fresh process."""
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=path.parent)


def test_a_script_without_a_main_guard_streams_with_worker_processes(corpus, tmp_path):
    root, docs = corpus
    script = tmp_path / "example.py"  # no `if __name__ == "__main__":`, as docs/streaming.md
    script.write_text(SCRIPT.format(root=str(root), cache=str(tmp_path / "cache"), L=L, B=B, S=S,
                                    **OPTS))
    res = run_script(script)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    ref = Reference(docs)
    assert len(got) == 6
    for step, rows in enumerate(got):
        assert np.array_equal(np.array(rows), ref.batch(step)["inputs"]), f"step {step}"


RESUME_SCRIPT = """\
import json, sys
from tokenmill import Loader
from tokenmill.base.errors import ConfigError

root, cache, state_file = sys.argv[1:4]
ld = Loader.from_text([root], seq_len={L}, batch_size={B}, cache_dir=cache, seed=0, rank=0,
                      world_size=1, num_workers=1, shuffle_buffer={S}, unit_bytes={unit_bytes},
                      shard_tokens={shard_tokens})
try:
    ld.load_state_dict(json.load(open(state_file)))
except ConfigError as e:
    print(json.dumps({{"refused": str(e)}}))
    sys.exit(3)
print(json.dumps({{"steps": [b["inputs"].tolist() for _, b in zip(range(4), ld)]}}))
ld.close()
"""


def test_a_state_whose_resume_from_contradicts_itself_is_refused(corpus, tmp_path):
    root, docs = corpus
    ref = Reference(docs)
    with make(corpus, tmp_path / "cache") as ld:
        take(ld, 80)
        state = ld.state_dict()
    hint = state["resume_from"]
    assert hint is not None and hint["unit"] > 2 and set(hint) == {"unit", "doc", "token", "check"}
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(L=L, B=B, S=S, **OPTS))
    edits = {  # the token no longer where that document begins: every window would shift
        "token": lambda r: r.update(token=0),
        "unit": lambda r: r.update(unit=hint["unit"] - 2),
        "check": lambda r: r.update(check="0" * 16),
        # no check (a state of an earlier version), even with a wrong token: slower, not different
        "unchecked": lambda r: r.pop("check"),
        "unchecked-wrong": lambda r: (r.pop("check"), r.update(token=0)),
        "unchecked-out-of-range": lambda r: (r.pop("check"), r.update(unit=10**6)),
        "untouched": lambda r: None,  # resumes exactly from its hint
    }
    runs, locks = {}, []
    for name, edit in edits.items():  # each in a fresh process, all at once
        other = tmp_path / f"other-{name}"  # its cache: another process holds the writer's lock,
        (other / ld.store_path.name).mkdir(parents=True)  # so reading starts from resume_from
        locks.append(os.open(other / ld.store_path.name / LOCK, os.O_RDWR | os.O_CREAT))
        fcntl.flock(locks[-1], fcntl.LOCK_EX)
        bad = json.loads(json.dumps(state))
        edit(bad["resume_from"])
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        runs[name] = subprocess.Popen([sys.executable, str(script), root, other,
                                       tmp_path / f"{name}.json"], cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = {name: (*p.communicate(timeout=120), p.returncode) for name, p in runs.items()}
    finally:
        for fd in locks:
            os.close(fd)
    for name, (stdout, stderr, code) in out.items():
        if name in ("token", "unit", "check"):
            assert code == 3, (name, stdout, stderr[-2000:])
            assert "resume_from" in json.loads(stdout)["refused"]
            continue
        assert code == 0, (name, stderr[-3000:])
        for j, rows in enumerate(json.loads(stdout)["steps"]):
            assert np.array_equal(np.array(rows), ref.batch(80 + j)["inputs"]), (name, j)


def test_a_state_whose_pass_samples_contradicts_the_store_is_refused(corpus, tmp_path):
    _, docs = corpus
    ref = Reference(docs)
    with make(corpus, tmp_path / "cache") as ld:
        take(ld, ref.n // B + 2)  # past the pass: the cache store is complete
        state = ld.state_dict()
    assert state["pass_samples"] == ref.n
    with make(corpus, tmp_path / "cache") as ld:
        for n in (ref.n - 1, ref.n + B):
            with pytest.raises(ConfigError, match="pass_samples"):
                ld.load_state_dict({**state, "pass_samples": n})
        for bad in ({"consumed_samples": True}, {"consumed_samples": 1.0},
                    {"consumed_samples": 2 ** 63},
                    {"resume_from": {"unit": -1, "doc": 0, "token": 0, "check": "0" * 16}}):
            with pytest.raises(ConfigError, match="|".join(bad)):
                ld.load_state_dict({**state, **bad})
        ld.load_state_dict({**state, "consumed_samples": np.int64(state["consumed_samples"])})
        for hint in ({"unit": 99, "doc": 0, "token": 0}, {"unit": -1}, "junk"):  # no check: ignored
            ld.load_state_dict({**state, "resume_from": hint})
        ld.load_state_dict({**state, "consumed_samples": np.int64(state["consumed_samples"])})
        assert_batches(take(ld, 2), ref, first_step=ref.n // B + 2, store=ld.store_path)


def test_an_earlier_iterator_raises_instead_of_ending_quietly(corpus, tmp_path):
    _, docs = corpus
    ref = Reference(docs)
    with make(corpus, tmp_path / "c") as ld:
        first = iter(ld)
        got = take(first, 3)
        second = iter(ld)  # a peek inside the loop: the batches continue here, none is lost
        got += take(second, 2)
        with pytest.raises(StaleIterator, match="iterated again"):
            next(first)
        assert_batches(got, ref)
        state = ld.state_dict()
        ld.load_state_dict(state)
        with pytest.raises(StaleIterator, match="load_state_dict"):
            next(second)
        third = iter(ld)
        assert_batches(take(third, 1), ref, first_step=5)
    with pytest.raises(StaleIterator, match="closed"):
        next(third)
    with pytest.raises(StaleIterator, match="closed"):
        iter(ld)


def test_the_docs_example_runs_as_a_script(tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "streaming.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    assert "__main__" not in code  # the point: a plain script, as a user saves it
    script = tmp_path / "example.py"
    script.write_text(code)
    res = run_script(script)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    consumed, stages = res.stdout.split(" ", 1)
    assert consumed == "2400" and "'tokenization'" in stages, res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data", "example.py"]


def test_compressed_inputs_stream_in_units_and_resume_mid_file(corpus, tmp_path):
    import gzip
    import zstandard
    _, docs = corpus
    root = tmp_path / "zipped"
    root.mkdir()
    half = len(docs) // 2
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in docs]
    (root / "a.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:half])))
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[half:])))
    ref = Reference(docs)
    with make((root, None), tmp_path / "c1", num_workers=1) as ld:
        got = take(ld, 120)
        state = ld.state_dict()
    assert_batches(got, ref)
    # two files, cut into units of decompressed text: the resume starts inside a compressed stream
    assert state["resume_from"]["unit"] > 2
    with make((root, None), tmp_path / "c2", num_workers=0) as ld:
        lock = ld.store_path / LOCK  # another process writes this cache: replay from resume_from
        ld.store_path.mkdir(parents=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            ld.load_state_dict(state)
            assert_batches(take(ld, 5), ref, first_step=120)
        finally:
            os.close(fd)


# ---- a global batch larger than the pass (issue 22, class 8) -------------------------------------

@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_a_global_batch_larger_than_the_pass_is_refused_not_repeated(tmp_path, layout):
    # three short documents: 2 concat windows or 4 packed rows of 16 tokens; a batch of 8 used to
    # hold the same row up to 8 times
    write_jsonl(tmp_path / "a.jsonl", [f"doc {i} " * 3 for i in range(3)])
    extra = {"layout": "packed", "pack_window": 2} if layout == "packed" else {}
    what = "packed rows" if layout == "packed" else "windows"
    for run in ("reading the text", "reading the complete cache"):
        for rank, world_size in ((0, 1), (1, 2)):
            ld = Loader.from_text([str(tmp_path / "a.jsonl")], seq_len=16, batch_size=8 // world_size,
                                  rank=rank, world_size=world_size, cache_dir=tmp_path / "cache",
                                  num_workers=0, **extra)
            with ld:
                for _ in range(2):  # refused, and again by a new iterator: never a batch
                    with pytest.raises(ConfigError, match=(
                            rf"^batch_size × world_size = 8 samples is more than one pass over "
                            rf"the text holds \(\d {what} of seq_len 16\).*lower batch_size")):
                        next(iter(ld))
        assert (tmp_path / "cache").is_dir(), run
    with Loader.from_text([str(tmp_path / "a.jsonl")], seq_len=16, batch_size=2, num_workers=0,
                          cache_dir=tmp_path / "cache", **extra) as ld:
        rows = take(ld, 1)[0]["inputs"]  # a batch the pass holds: distinct rows
        assert len({r.tobytes() for r in rows}) == 2


# ---- the end of the pass: streamed, or read from the complete cache (issue 22) ------------------

PASS_END_SCRIPT = """\
import json, sys
from tokenmill import Loader

root, cache, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = []
for job in jobs:  # each: its settings, a state to resume from (or null: from the start), steps
    B, S = job["batch_size"], job["shuffle_buffer"]
    with Loader.from_text([root], seq_len={L}, batch_size=B, cache_dir=f"{{cache}}-{{B}}-{{S}}",
                          seed={seed}, num_workers=0, shuffle_buffer=S, unit_bytes=700) as ld:
        if job["state"] is not None:
            ld.load_state_dict(job["state"])
        batches, states = [], []
        for _, b in zip(range(job["steps"]), ld):
            batches.append(b["inputs"].tolist())
            states.append(ld.state_dict())
        out.append({{"batches": batches, "states": states, "pass_samples": ld.pass_samples}})
print(json.dumps(out))
"""


def test_a_streamed_pass_ends_as_the_pass_read_from_its_complete_cache(tmp_path):
    # A pass holds (tokens − L) // L windows, the store's epoch, whatever the epoch-0 offset o:
    # the stream counted (tokens − o − 1) // L when it emitted a window before it had read the
    # end of the text, one more when o leaves room at the end, so the last samples of the pass
    # differed between the run that streamed it and a rerun or a resume that found the cache
    # complete (here: 40 windows fit after the offset, the store's epoch holds 39)
    n = 39
    docs, total = [], 0
    for d in (d for d in paragraphs(20_000) if d.isascii()):  # a byte a character
        d = d[:(n + 2) * L - 1 - total - 1]  # the last one cut: L − 1 tokens past 40 windows
        docs.append(d)
        total += len(d) + 1  # and its EOS
        if total == (n + 2) * L - 1:
            break
    root = tmp_path / "text"
    root.mkdir()
    write_jsonl(root / "a.jsonl", docs)
    tokens = len(stream_tokens(docs))
    seed = next(s for s in range(100) if concat_offset(L, seed=s, epoch=0) < tokens % L)
    assert (tokens - L) // L == n
    script = tmp_path / "run.py"
    script.write_text(PASS_END_SCRIPT.format(L=L, seed=seed))

    def run(jobs):
        res = run_script(script, root, tmp_path / "cache", json.dumps(jobs))
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout)

    settings = [{"batch_size": b, "shuffle_buffer": s} for b in (1, 2, 3) for s in (1, 4, 16)]
    steps = {b: n // b + 3 for b in (1, 2, 3)}  # the whole pass and into the store's epoch 1
    # empty caches: each pass is streamed
    streamed = run([{**s, "state": None, "steps": steps[s["batch_size"]]} for s in settings])
    # again from the start on the complete caches, and resumed at every step near the end
    jobs = []
    for s, first in zip(settings, streamed):
        assert first["pass_samples"] == n, s
        b = s["batch_size"]
        jobs.append({**s, "state": None, "steps": steps[b]})
        jobs += [{**s, "state": first["states"][k], "steps": steps[b] - 1 - k}
                 for k in range(n // b - 8, steps[b] - 1)]
    reruns = iter(run(jobs))
    for s, first in zip(settings, streamed):
        again = next(reruns)
        assert again["pass_samples"] == n, s
        assert again["batches"] == first["batches"], f"{s}: from the start on the complete cache"
        for k in range(n // s["batch_size"] - 8, steps[s["batch_size"]] - 1):
            got = next(reruns)
            assert got["batches"] == first["batches"][k + 1:], f"{s}: resumed after step {k}"


REWRITE_SCRIPT = """
import sys
import numpy as np
from tokenmill import Loader
loader = Loader.from_text(sys.argv[1], seq_len=16, batch_size=4, cache_dir=sys.argv[2],
                          num_workers=0, shuffle_buffer=1)
ids = np.concatenate([np.asarray(b["inputs"]).ravel() for _, b in zip(range(60), loader)])
loader.close()
sys.stdout.write(bytes(int(t) for t in ids if t < 256).decode())
"""


def test_a_finished_cache_of_an_input_rewritten_under_the_same_size_and_mtime_is_not_reused(
        tmp_path):
    # before: the cache key hashes sizes and mtimes only, so the second run read the old text
    # back from the finished cache, with no message
    data = tmp_path / "x.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc{i:02} lorem ipsum dolor"}) + "\n"
                            for i in range(40)))
    script, cache = tmp_path / "run.py", tmp_path / "cache"
    script.write_text(REWRITE_SCRIPT)

    def run():
        res = run_script(script, data, cache)
        assert res.returncode == 0, res.stderr[-3000:]
        return res

    first = run()  # the whole pass and into epoch 1: the cache is finished
    assert "lorem" in first.stdout and "LOREM" not in first.stdout
    assert [p.name for p in cache.glob("stream-*/manifest.json")] == ["manifest.json"]
    st = data.stat()
    data.write_bytes(data.read_bytes().replace(b"lorem", b"LOREM"))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = run()
    assert "LOREM" in second.stdout and "lorem" not in second.stdout
    assert f"{data} (same size and modification time, other bytes)" in second.stderr
    assert len(list(cache.glob("stream-*/manifest.json"))) == 2  # the old cache stays as it was
    third = run()  # the new cache is reused, read back with no tokenizing
    assert third.stdout == second.stdout
    assert len(list(cache.glob("stream-*/manifest.json"))) == 2
