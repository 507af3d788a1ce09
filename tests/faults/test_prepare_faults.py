"""prepare under faults: kill -9, Ctrl-C, a full disk, a dead worker; never a store cut short.

Failure classes: preprocessing that stalls or ends early (plus the prepare side of stale shared
memory and leftover temp files).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import stdlib_texts, write_jsonl
from faults.conftest import (SIZE, assert_exits_promptly, assert_nothing_left, child_env,
                             descendants, files_under, press_ctrl_c, program, record, stale_shm,
                             stop_and_kill, survivors)
from tokenmill.inputs import sources
from tokenmill.base.errors import StoreError
from tokenmill.prepare import prepare
from tokenmill.store import TokenStore, read_manifest, verify_store
from tokenmill.tokenizer import encode_documents, load_tokenizer

SETTINGS = {"shard_tokens": 20_000, "unit_bytes": 48_000}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~1.5 MB of real text in 24 JSONL files, a zstd JSONL and a 5-row-group parquet."""
    src = tmp_path_factory.mktemp("corpus") / "src"
    src.mkdir()
    texts = stdlib_texts(1_500_000)
    for i in range(22):
        write_jsonl(src / f"part-{i:02d}.jsonl", texts[i::24])
    (src / "part-22.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[22::24]).encode()))
    pq.write_table(pa.table({"text": texts[23::24]}), src / "part-23.parquet",
                   row_group_size=max(1, len(texts[23::24]) // 5))
    return src


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, bpe_tokenizer):
    """The store an uninterrupted prepare writes (one worker, in this process): every file's bytes."""
    out = tmp_path_factory.mktemp("ref") / "store"
    prepare([str(corpus)], out=out, tokenizer=bpe_tokenizer, workers=1, progress=False, **SETTINGS)
    return out, snapshot(out)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file below path (hidden and nested too), by relative name."""
    return {name: (path / name).read_bytes() for name in files_under(path)}


def assert_whole_store(out: Path, ref: dict[str, bytes], what: str) -> None:
    """A run stopped after its commit (the manifest) left the whole store, and maybe the .lock
    and .progress it had yet to remove (the next run removes them)."""
    left = snapshot(out)
    assert {n: left.get(n) for n in ref} == ref, f"{what} left a bad store"
    assert all(n == ".lock" or n.startswith(".progress/") for n in set(left) - set(ref)), \
        f"{what} left {sorted(set(left) - set(ref))}"


def prepare_args(corpus, out, tokenizer, **extra) -> str:
    return json.dumps({"inputs": [str(corpus)], "out": str(out), "tokenizer": tokenizer,
                       "workers": 2, **SETTINGS, **extra})


def run_to_end(args: str, env: dict, timeout: float = 120, meanwhile=lambda: None) -> None:
    """Run prepare to its end (calling ``meanwhile()`` while it runs); it must succeed."""
    proc = subprocess.Popen(program("prepare", args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        meanwhile()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "done" in out, err


def committed(out: Path) -> int:
    """Shards committed by an unfinished prepare."""
    return len(list((out / ".progress").glob("shard-*.json"))) if (out / ".progress").is_dir() else 0


def looks_complete(out: Path) -> bool:
    try:
        read_manifest(out)
        return True
    except StoreError:
        return False


def kill9_at(args: str, env: dict, when: float, out: Path | None = None, commits: int = 1,
             latest: float | None = None) -> tuple[list, set, bool]:
    """Start prepare, SIGKILL it ``when`` seconds later (after its ``commits``-th shard commit
    into ``out`` if given), but no later than ``latest`` seconds after its start if given:
    (its descendants, the /dev/shm entries they used, finished before). Its main process (the
    writer) is stopped at that moment, and killed once its processes have been looked at."""
    proc = subprocess.Popen(program("prepare", args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        end = t0 + 60 if latest is None else t0 + latest
        while out is not None and committed(out) < commits and proc.poll() is None:
            if time.monotonic() > end:
                assert latest is not None, "prepare commits no shard: it stalls"
                break
            time.sleep(0.002)
        time.sleep(max(0.0, min(when, end - time.monotonic())))
        # stopped there: a running prepare commits a dozen shards in the time the scan takes
        kids, shm, _ = stop_and_kill(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return kids, shm, proc.returncode == 0


def test_kill9_prepare_10x_every_rerun_finishes_byte_identical(tmp_path, corpus, bpe_tokenizer,
                                                               reference):
    _, ref = reference
    env = child_env(tmp_path / "tmp")
    whole, t0, first_commit = tmp_path / "whole", time.monotonic(), []

    def until_first_commit():
        deadline = time.monotonic() + 60
        while not committed(whole) and not looks_complete(whole) and time.monotonic() < deadline:
            time.sleep(0.002)
        first_commit.append(time.monotonic() - t0)
    run_to_end(prepare_args(corpus, whole, bpe_tokenizer), env, meanwhile=until_first_commit)
    assert snapshot(whole) == ref  # 2 workers, another process: the same bytes
    shards = sum(name.endswith(".bin") for name in ref)
    # Kills are placed by the run's own progress, not by seconds measured on another run. A run
    # is ~0.7 s on an idle 2-core machine: ~0.6 s to start and tokenize the first units, then
    # all 15 shards commit within ~60 ms, then the manifest; on a loaded machine one run's
    # duration is no measure of the next, and "0.9 x the first run's duration" came after the
    # end. A start-up kill is due at a random time before the first run's first commit, or at
    # this run's first commit if that is sooner; a later kill follows commit k at once.
    rng = random.Random(3)
    mid_run = with_shards = chained = redone = shm_cleaned = 0
    for cycle in range(SIZE.prepare_kills):
        out = tmp_path / f"out{cycle}"
        args = prepare_args(corpus, out, bpe_tokenizer)
        if cycle % 4 == 0:  # start-up: imports, listing, spawning workers, tokenizing
            kids, shm, finished = kill9_at(args, env, 0, out, commits=1,
                                           latest=rng.uniform(0.05, 1.0) * first_commit[0])
        elif cycle % 4 == 2:  # writing shards; every other time, the manifest (after the last)
            k = shards if cycle % 8 == 6 else rng.randint(1, shards - 1)
            kids, shm, finished = kill9_at(args, env, rng.uniform(0, 0.005), out, commits=k)
        else:  # right after one of the first shard commits
            kids, shm, finished = kill9_at(args, env, rng.uniform(0, 0.02), out,
                                           commits=rng.randint(1, 4))
        mid_run += not finished and not looks_complete(out)
        with_shards += committed(out) > 0
        if cycle % 4 == 3 and not looks_complete(out):  # kill the rerun too: resume a resume
            k = min(shards - 1, committed(out) + rng.randint(1, 3))
            more, more_shm, _ = kill9_at(args, env, rng.uniform(0, 0.005), out, commits=k)
            kids, shm = kids + more, shm | more_shm
            chained += 1
        if cycle % 4 == 1 and committed(out):  # a committed shard damaged meanwhile is redone
            shard = out / "shard-00000.bin"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            redone += 1
        if looks_complete(out):  # killed after its commit (the manifest)
            assert_whole_store(out, ref, "a killed run")

        def no_leftovers(cycle=cycle, kids=kids, shm=shm):  # while the rerun starts
            assert not survivors(kids), f"cycle {cycle}: orphan workers: {survivors(kids)}"
            assert stale_shm(shm) == [], f"cycle {cycle}: stale shared memory"
        run_to_end(args, env, meanwhile=no_leftovers)
        shm_cleaned += len(shm)
        assert snapshot(out) == ref, f"cycle {cycle}: the resumed store differs"
        assert verify_store(out) == []
        assert files_under(tmp_path / "tmp") == []
    assert mid_run >= SIZE.prepare_kills * 7 // 10, "the kills landed after prepare finished"
    assert with_shards >= SIZE.prepare_kills // 2 and redone >= SIZE.prepare_kills // 4
    record("kill -9 prepare", kills=SIZE.prepare_kills + chained, cycles=SIZE.prepare_kills,
           killed_mid_run=mid_run, killed_after_a_shard_commit=with_shards,
           chained_resumes=chained, damaged_shards_redone=redone, byte_identical=SIZE.prepare_kills,
           orphans=0, shm_entries_at_kill=shm_cleaned, shm_left=0)


def cli_prepare(corpus, out, tokenizer) -> list[str]:
    return [sys.executable, "-m", "tokenmill", "prepare", str(corpus), "--out", str(out),
            "--tokenizer", tokenizer, "--workers", "2", "--shard-tokens",
            str(SETTINGS["shard_tokens"]), "--quiet"]


def test_ctrl_c_during_prepare_exits_promptly_and_leaves_nothing_behind(tmp_path, corpus,
                                                                        bpe_tokenizer, reference):
    _, ref = reference
    rng = random.Random(4)
    exits = []
    for i in range(SIZE.interrupts):
        out, tmp = tmp_path / f"out{i}", tmp_path / f"tmp{i}"
        env = child_env(tmp)

        def ready(proc):  # past start-up: its workers are running
            deadline = time.monotonic() + 60
            while not descendants(proc.pid) and proc.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        hit = press_ctrl_c(cli_prepare(corpus, out, bpe_tokenizer), env, ready=ready,
                           delay=rng.uniform(0, 0.6), stdout=subprocess.DEVNULL)
        exits.append(hit.seconds)
        assert_exits_promptly(hit)
        if hit.code == -signal.SIGINT and not hit.err:  # it had finished: Ctrl-C while exiting
            assert_whole_store(out, ref, "a Ctrl-C while exiting")
        elif hit.code != 0:  # (or it had finished just before)
            assert hit.code == 130, hit.err
            assert "tokenmill prepare: interrupted; run the same command again to resume" in hit.err
            assert "Traceback" not in hit.err, hit.err
        assert_nothing_left(hit.kids, hit.shm, tmp, what="after Ctrl-C: ")
        assert not [f for f in files_under(out) if ".tmp" in f], files_under(out)
        if looks_complete(out):  # the Ctrl-C came after the manifest, before the clean-up
            assert_whole_store(out, ref, "a Ctrl-C after the commit")
        if i % 2:  # the interrupted store finishes on a rerun
            run_to_end(json.dumps({"inputs": [str(corpus)], "out": str(out),
                                   "tokenizer": bpe_tokenizer, "workers": 2,
                                   "shard_tokens": SETTINGS["shard_tokens"]}), env)
            assert snapshot(out) == ref
    record("Ctrl-C prepare", interrupts=SIZE.interrupts, slowest_exit_s=round(max(exits), 2),
           left_behind=0)


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_disk_full_during_prepare_is_a_clear_error_and_a_rerun_finishes(tmp_path, corpus,
                                                                        bpe_tokenizer, reference):
    _, ref = reference
    # a corpus of many small shards, whose manifest is its biggest file
    small = tmp_path / "small"
    small.mkdir()
    write_jsonl(small / "s.jsonl", [f"document {i} " * (i % 7 + 1) for i in range(300)])
    small_args = {"inputs": [str(small)], "tokenizer": "bytes", "workers": 2,
                  "shard_tokens": 100}
    prepare(out=tmp_path / "small-ref", progress=False, **{**small_args, "workers": 1})
    small_ref = snapshot(tmp_path / "small-ref")
    biggest_other = max(len(v) for k, v in small_ref.items() if k != "manifest.json")
    assert biggest_other < len(small_ref["manifest.json"]) // 2
    # the first write past the limit fails: the first shard, a later (bigger) one, the manifest
    sizes = [len(v) for k, v in sorted(ref.items()) if k.endswith(".bin")]
    later = next(i for i in range(1, len(sizes)) if sizes[i] > max(sizes[:i]))
    cases = {"first shard": (4_096, None), "a later shard": (max(sizes[:later]), None),
             "the manifest": (len(small_ref["manifest.json"]) // 2, small_args)}
    kept = {}
    for what, (limit, small_case) in cases.items():
        out = tmp_path / what.replace(" ", "-")
        args = (json.dumps({**small_case, "out": str(out)}) if small_case else
                prepare_args(corpus, out, bpe_tokenizer))
        env = child_env(tmp_path / "tmp")
        full = subprocess.run(program("prepare", args), env=env, capture_output=True, text=True,
                              timeout=120, preexec_fn=_limit_file_size(limit))
        assert full.returncode != 0, f"{what}: prepare succeeded with a full disk"
        last = full.stderr.strip().splitlines()[-1]
        # a clear error: tokenmill's own, saying the disk is full and how to finish
        assert last.startswith("tokenmill.base.errors.DiskFullError") and "disk is full" in last \
            and "again" in last, full.stderr
        assert not looks_complete(out), f"{what}: a store that looks complete"
        assert not [f for f in files_under(out) if ".tmp" in f], files_under(out)
        kept[what] = committed(out)
        run_to_end(args, env)  # space again: the rerun finishes the same store
        assert snapshot(out) == (small_ref if small_case else ref)
        assert files_under(tmp_path / "tmp") == []
    assert kept["first shard"] == 0 and kept["a later shard"] == later
    assert kept["the manifest"] == len([k for k in small_ref if k.endswith(".bin")])
    record("disk full", cases=len(cases), shards_kept_then_resumed=sum(kept.values()),
           clear_errors=len(cases), complete_looking_stores=0, temp_files=0)


def test_preprocessing_stalls_never_a_dead_worker_is_an_error_not_a_hang(tmp_path, corpus,
                                                                         bpe_tokenizer, reference):
    _, ref = reference
    out = tmp_path / "out"
    args = prepare_args(corpus, out, bpe_tokenizer)
    env = child_env(tmp_path / "tmp")
    proc = subprocess.Popen(program("prepare", args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (workers := [p for p in descendants(proc.pid)
                               if "tokenmill.base.child" in " ".join(p.cmdline())]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = workers[0].pid
        workers[0].kill()  # the OOM killer's way: SIGKILL, while the run starts
        t0 = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    if code == 0:  # it had already finished: nothing to test this time
        pytest.fail("prepare finished before its worker could be killed; grow the corpus")
    assert "worker" in err.splitlines()[-1] and "again" in err.splitlines()[-1], err
    # the real exit reason: which worker, and that it was SIGKILL (not a made-up guess)
    assert f"(pid {victim}) was killed by SIGKILL (out of memory?)" in err, err
    assert not looks_complete(out)
    run_to_end(args, env)
    assert snapshot(out) == ref
    record("dead prepare worker", error_after_s=round(took, 2), hangs=0)


def test_preprocessing_never_ends_early_every_document_in_order(tmp_path, bpe_tokenizer):
    """Units cut inside records, odd line endings, every format: the store holds exactly the
    documents the readers yield, in order, none lost at a unit or shard boundary."""
    src = tmp_path / "src"
    src.mkdir()
    texts = [t[i:i + 3_000] for t in stdlib_texts(600_000) for i in range(0, len(t), 3_000)]
    q = len(texts) // 4
    write_jsonl(src / "a.jsonl", texts[:q])
    (src / "b.txt").write_bytes("\r\n".join(t.replace("\n", " ") for t in texts[q:2 * q])
                                .encode() + b"\n\n\n")
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[2 * q:3 * q]).encode()))
    pq.write_table(pa.table({"text": texts[3 * q:]}), src / "d.parquet", row_group_size=3)
    config = sources.SourceConfig(txt_mode="lines", unit_bytes=5_000)
    docs = [d for d in sources.read_documents([str(src)], config) if isinstance(d, str)]
    tok = load_tokenizer(bpe_tokenizer)
    tokens, lengths = encode_documents(tok, docs)
    out = tmp_path / "out"
    subprocess.run(program("prepare", json.dumps({
        "inputs": [str(src)], "out": str(out), "tokenizer": bpe_tokenizer, "workers": 2,
        "txt_mode": "lines", "unit_bytes": 5_000, "shard_tokens": 7_000})), check=True,
        env=child_env(tmp_path / "tmp"), timeout=120)
    with TokenStore(out) as store:
        assert len(store) == len(docs) and store.num_shards > 5
        assert store.doc_lengths.tolist() == lengths.tolist()
        assert store.tokens(0, store.num_tokens).tolist() == tokens.tolist()
    record("prepare ends early", documents=len(docs), units=len(sources.plan_units(
        sources.list_files([str(src)])[0], config)), lost=0)


def test_an_input_rewritten_between_kill_and_resume_is_redone_never_mixed(tmp_path):
    """Issue 12.6: same size, same mtime, other bytes — the resumed store is the new text's."""
    src = tmp_path / "src"
    src.mkdir()
    texts = stdlib_texts(800_000)
    first = write_jsonl(src / "a.jsonl", texts[::2])
    write_jsonl(src / "b.jsonl", texts[1::2])
    out, env = tmp_path / "out", child_env(tmp_path / "tmp")
    args = json.dumps({"inputs": [str(src)], "out": str(out), "tokenizer": "bytes", "workers": 2,
                       **SETTINGS})
    _, _, finished = kill9_at(args, env, 0, out, commits=2)
    assert not finished and committed(out) >= 2
    data, stat = first.read_bytes(), first.stat()
    assert 0 <= data.find(b"def ") < SETTINGS["unit_bytes"]  # inside the first, committed unit
    first.write_bytes(data.replace(b"def ", b"DEF "))
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert first.stat().st_size == stat.st_size and first.stat().st_mtime_ns == stat.st_mtime_ns
    rerun = subprocess.run(program("prepare", args), env=env, capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    fresh = tmp_path / "fresh"
    prepare([str(src)], out=fresh, tokenizer="bytes", workers=1, progress=False, **SETTINGS)
    assert snapshot(out) == snapshot(fresh)
    with TokenStore(out) as store:
        assert b"DEF " in store.tokens(0, 50_000).astype("uint8").tobytes()
    record("input rewritten under the same size and mtime", redone=1, mixed_stores=0)
