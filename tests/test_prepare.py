"""prepare: formats end to end, worker-count independence, resume after SIGKILL, bad input."""

import functools
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import docs_of, kill_after_first_commit, store_bytes, write_jsonl
from tokenmill.base.errors import ConcurrentWriterError, ConfigError, InputError, StoreError
from tokenmill.prepare import prepare
from tokenmill.store import TokenStore, verify_store
from tokenmill.tokenizer import load_tokenizer

EOS = 256


def byte_ids(text: str) -> list[int]:
    """What the built-in byte tokenizer stores for a document: UTF-8 bytes, then EOS."""
    return list(text.encode("utf-8")) + [EOS]


def test_every_format_round_trips_exactly(tmp_path):
    texts = ["héllo wörld", "second doc\nwith two lines", "日本語のテキスト", "emoji 🎉 done"]
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", texts[:2])
    with gzip.open(src / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": texts[2]}) + "\n")
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"text": texts[3]}) + "\n").encode()))
    pq.write_table(pa.table({"text": texts + ["tail"]}), src / "d.parquet", row_group_size=2)
    (src / "e.txt").write_text("a whole file\n\nas one document\n", encoding="utf-8")
    m = prepare([str(src)], out=tmp_path / "store", workers=1, progress=False)
    want = texts[:2] + [texts[2], texts[3]] + texts + ["tail"] + ["a whole file\n\nas one document\n"]
    assert docs_of(tmp_path / "store") == [byte_ids(t) for t in want]
    assert m["num_documents"] == len(want) and m["skipped"]["total"] == 0
    assert verify_store(tmp_path / "store") == []


@pytest.mark.parametrize("mode,want", [
    ("lines", ["one", "two", "three"]),
    ("paragraphs", ["one\ntwo", "three"]),
])
def test_txt_modes(tmp_path, mode, want):
    (tmp_path / "t.txt").write_text("one\ntwo\n\nthree\n")
    m = prepare([str(tmp_path / "t.txt")], out=tmp_path / "s", txt_mode=mode, workers=1,
                progress=False)
    assert docs_of(tmp_path / "s") == [byte_ids(t) for t in want]
    if mode == "lines":
        assert m["skipped"]["by_reason"] == {"empty_document": 1}


def test_byte_identical_for_any_worker_count(tmp_path, real_texts, bpe_tokenizer):
    write_jsonl(tmp_path / "corpus.jsonl", real_texts)
    stores = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare([str(tmp_path / "corpus.jsonl")], out=out, tokenizer=bpe_tokenizer,
                workers=workers, shard_tokens=40_000, unit_bytes=64_000, progress=False)
        stores.append(store_bytes(out))
    assert len(stores[0]) > 6  # several shards, so boundaries are exercised
    assert stores[0] == stores[1]


def test_fast_and_slow_tokenizer_engines_write_identical_stores(tmp_path, real_texts, bpe_tokenizer):
    write_jsonl(tmp_path / "c.jsonl", real_texts[:60])
    engines = {"auto": {"tokenizer_engine": "auto"}, "hf": {"tokenizer_engine": "hf"},
               "old-spelling": {"fast_tokenizer": False}}  # the deprecated alias of "hf"
    stores, manifests = {}, {}
    for name, option in engines.items():
        manifests[name] = prepare([str(tmp_path / "c.jsonl")], out=tmp_path / name,
                                  tokenizer=bpe_tokenizer, workers=1, progress=False, **option)
        stores[name] = store_bytes(tmp_path / name)
        manifest = json.loads(stores[name].pop("manifest.json"))
        assert manifest == manifests[name]
        for informative in ("tokenizer_engine", "manifest_xxh3"):  # not what the store holds
            manifest.pop(informative)
        stores[name]["manifest"] = manifest
    assert stores["auto"] == stores["hf"] == stores["old-spelling"]
    auto = load_tokenizer(bpe_tokenizer)  # fastokens where installed
    assert manifests["auto"]["tokenizer_engine"] == {"name": auto.engine,
                                                     "notes": list(auto.engine_notes)}
    assert manifests["hf"]["tokenizer_engine"]["name"] == "tokenizers"
    assert manifests["old-spelling"]["tokenizer_engine"]["name"] == "tokenizers"
    assert "tokenizer_engine" not in manifests["hf"]["settings"]


def _prepare_cmd(inputs, out, tokenizer):
    return [sys.executable, "-m", "tokenmill", "prepare", *inputs, "--out", str(out),
            "--tokenizer", tokenizer, "--workers", "2", "--shard-tokens", "30000", "--quiet"]


def test_resume_after_sigkill_is_byte_identical(tmp_path, real_texts, bpe_tokenizer):
    import psutil
    corpus = write_jsonl(tmp_path / "corpus.jsonl", real_texts * 3)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = tmp_path / "ref"
    t0 = time.monotonic()
    subprocess.run(_prepare_cmd([str(corpus)], ref, bpe_tokenizer), check=True, env=env)
    duration = time.monotonic() - t0
    rng = random.Random(1234)
    interrupted = 0
    for trial in range(3):
        out = tmp_path / f"run{trial}"
        proc = subprocess.Popen(_prepare_cmd([str(corpus)], out, bpe_tokenizer), env=env)
        time.sleep(rng.uniform(0.15, 0.9) * duration)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += not (out / "manifest.json").exists()
        # the workers notice their parent is gone and exit by themselves (60 s: a hang guard
        # only; they are not killed, so none that lingers can pass)
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, f"orphan workers after SIGKILL: {alive}"
        subprocess.run(_prepare_cmd([str(corpus)], out, bpe_tokenizer), check=True, env=env)
        assert store_bytes(out) == store_bytes(ref)
    assert interrupted >= 2, "the kills landed after prepare finished; the test proved nothing"


def test_rerun_of_finished_store_is_a_no_op_and_other_settings_are_refused(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc", "def"])
    out = tmp_path / "s"
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    before = store_bytes(out)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    assert store_bytes(out) == before
    with pytest.raises(ConfigError, match="other settings"):
        prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False, shard_tokens=7)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False, shard_tokens=7,
            overwrite=True)
    assert len(TokenStore(out).manifest["shards"]) == 1


BAD_CASES = {
    # name: (file name, content bytes, reason, where-fragment)
    "malformed_json": ("a.jsonl", b'{"text": "ok"}\n{"text": broken\n', "malformed_json", ":2"),
    "missing_field": ("a.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', "missing_field", ":2"),
    "non_string_field": ("a.jsonl", b'{"text": "ok"}\n{"text": 42}\n', "non_string_field", ":2"),
    "invalid_utf8": ("a.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "invalid_utf8", ":2"),
    "binary_file": ("a.txt", b"ok" + bytes(100), "binary_file", "a.txt"),
    "empty_file": ("a.jsonl", b"", "empty_file", "a.jsonl"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raise_names_file_and_line(tmp_path, case):
    name, content, reason, where = BAD_CASES[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content)
    write_jsonl(tmp_path / "in" / "good.jsonl", ["fine"])
    with pytest.raises(InputError) as e:
        prepare([str(tmp_path / "in")], out=tmp_path / "s", workers=1, progress=False)
    assert name in str(e.value) and where in str(e.value)
    assert e.value.reason == reason
    assert not (tmp_path / "s" / "manifest.json").exists()


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_skip_counts_and_keeps_the_rest(tmp_path, case):
    name, content, reason, _ = BAD_CASES[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content)
    write_jsonl(tmp_path / "in" / "good.jsonl", ["fine"])
    m = prepare([str(tmp_path / "in")], out=tmp_path / "s", workers=1, progress=False,
                on_error="skip")
    assert m["skipped"]["by_reason"] == {reason: 1}
    assert m["skipped"]["examples"][0]["path"].endswith(name)
    kept = [byte_ids("ok")] if content.startswith(b'{"text": "ok"}') else []
    kept += [byte_ids("fine")] if name != "good.jsonl" else []
    assert docs_of(tmp_path / "s")[-len(kept):] == kept and len(docs_of(tmp_path / "s")) == len(kept)


def test_no_match_and_nothing_left(tmp_path):
    with pytest.raises(InputError, match="nothing-here"):
        prepare([str(tmp_path / "nothing-here*.jsonl")], out=tmp_path / "s", workers=1,
                progress=False)
    write_jsonl(tmp_path / "only-empty.jsonl", ["", ""])
    with pytest.raises(InputError, match="no documents"):
        prepare([str(tmp_path / "only-empty.jsonl")], out=tmp_path / "s2", workers=1,
                progress=False)
    assert not (tmp_path / "s2" / "manifest.json").exists()


def test_unreadable_file(tmp_path):
    if os.geteuid() == 0:
        # root reads anything: a directory named like an input file is unreadable as a file
        (tmp_path / "x.jsonl").mkdir()
        bad = tmp_path / "x.jsonl"
    else:
        bad = write_jsonl(tmp_path / "x.jsonl", ["a"])
        bad.chmod(0)
    with pytest.raises(InputError):
        prepare([str(bad)], out=tmp_path / "s", workers=1, progress=False)


def test_tokenizer_kinds_through_prepare(tmp_path, real_texts, bpe_tokenizer):
    from tokenmill.tokenizer import load_tokenizer
    write_jsonl(tmp_path / "c.jsonl", real_texts[:5])
    prepare([str(tmp_path / "c.jsonl")], out=tmp_path / "hf", tokenizer=bpe_tokenizer, workers=1,
            progress=False)
    tok = load_tokenizer(bpe_tokenizer)
    with TokenStore(tmp_path / "hf") as s:
        assert s.dtype == np.uint16
        assert s.tokenizer == tok.identity()
        for i, text in enumerate(real_texts[:5]):
            assert s[i].tolist() == tok.encode_batch([text])[0].tolist() + [tok.eos_id]


# ---- issue 12: what prepare may delete (1), one writer at a time (2), dead workers (15),
# ---- path spellings and what differs (18), no credentials recorded ----------------------------

def _cli(*args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill", "prepare", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_prepare_into_the_folder_of_its_inputs_never_deletes_them(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "shard-00000.jsonl", [f"first file {i}" for i in range(50)])
    write_jsonl(data / "shard-00001.jsonl", [f"second file {i}" for i in range(50)])
    inputs = _files(data)
    for extra in ([], [], ["--overwrite", "--shard-tokens", "300"]):  # a run, a rerun, a redo
        done = _cli(data / "shard-00000.jsonl", data / "shard-00001.jsonl", "--out", data,
                    "--workers", "1", "--quiet", *extra)
        assert done.returncode == 0, done.stderr
        assert {k: v for k, v in _files(data).items() if k.endswith(".jsonl")} == inputs
        assert verify_store(data) == []
    assert docs_of(data)[-1] == byte_ids("second file 49")


def test_unrelated_files_in_out_are_left_alone(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc", "def"])
    out = tmp_path / "out"
    out.mkdir()
    theirs = {"shard-7.csv": b"a,b\n", "shard-00003.txt": b"notes\n", "notes.md": b"# mine\n",
              "shard-00001.bin.bak": b"x"}
    for name, data in theirs.items():
        (out / name).write_bytes(data)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False, shard_tokens=3,
            overwrite=True)
    assert {k: v for k, v in _files(out).items() if k in theirs} == theirs
    assert verify_store(out) == [] and len(TokenStore(out).manifest["shards"]) == 2


def test_a_shard_file_prepare_did_not_write_is_refused_by_name_and_kept(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc", "def"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00003.bin").write_bytes(b"someone else's")
    done = _cli(tmp_path / "c.jsonl", "--out", out, "--workers", "1", "--quiet")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "shard-00003.bin" in done.stderr and "move" in done.stderr, done.stderr
    assert (out / "shard-00003.bin").read_bytes() == b"someone else's"
    assert not (out / "manifest.json").exists()
    # beside a finished store too, and --overwrite does not change that
    (out / "shard-00003.bin").unlink()
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    (out / "shard-00009.idx").write_bytes(b"stray")
    for overwrite in (False, True):
        with pytest.raises(StoreError, match="shard-00009.idx"):
            prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False,
                    shard_tokens=3, overwrite=overwrite)
    assert (out / "shard-00009.idx").read_bytes() == b"stray" and verify_store(out) == []


def test_a_manifest_prepare_cannot_read_is_not_overwritten(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "another tool\'s manifest"}')
    for overwrite in (False, True):
        with pytest.raises(StoreError, match="manifest"):
            prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False,
                    overwrite=overwrite)
    assert (out / "manifest.json").read_text() == '{"name": "another tool\'s manifest"}'


LOCK_HOLDER = """
import sys, time
from pathlib import Path
from tokenmill.store.writer import take_lock
fd = take_lock(Path(sys.argv[1]), sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_writer_holding_the_output_lock_makes_prepare_fail_fast(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc"])
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "holder.py"
    script.write_text(LOCK_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConcurrentWriterError, match=f"pid {holder.pid}") as info:
            prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
        # failed while the holder still holds the lock (it sleeps 600 s): it did not wait for it
        assert info.value.pid == holder.pid and holder.poll() is None
        done = _cli(tmp_path / "c.jsonl", "--out", out, "--quiet")
        assert done.returncode != 0 and f"pid {holder.pid}" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the lock with the holder: prepare proceeds
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    assert verify_store(out) == [] and not (out / ".lock").exists()


def test_two_prepares_into_one_out_at_once_exactly_one_proceeds(tmp_path, real_texts):
    half = len(real_texts) // 2
    a = write_jsonl(tmp_path / "a.jsonl", real_texts[:half])
    b = write_jsonl(tmp_path / "b.jsonl", real_texts[half:])
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "tokenmill", "prepare", str(src), "--out",
                               str(out), "--workers", "2", "--shard-tokens", "50000", "--quiet"],
                              stderr=subprocess.PIPE, text=True) for src in (a, b)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, results
    loser = next(err for code, err in results if code != 0)
    assert "another tokenmill process (pid" in loser and "Traceback" not in loser, loser
    winner = next(i for i, (code, _) in enumerate(results) if code == 0)
    ref = tmp_path / "ref"
    prepare([str((a, b)[winner])], out=ref, workers=1, progress=False, shard_tokens=50_000)
    assert verify_store(out) == [] and docs_of(out) == docs_of(ref)


class ExitInWorker:
    """A task whose unpickling, in the worker, writes to stderr and exits with code 3."""

    def __reduce__(self):
        return exec, ("import os, sys; sys.stderr.write('reader exploded on line 7\\n'); "
                      "sys.stderr.flush(); os._exit(3)",)


def test_a_worker_that_exits_reports_its_code_and_stderr_and_no_false_advice():
    from tokenmill.base.errors import WorkerError
    from tokenmill.prepare import PrepareConfig, UnitPool
    with UnitPool(2, PrepareConfig()) as pool:
        pool.submit(0, ExitInWorker())
        with pytest.raises(WorkerError) as info:
            pool.wait(0)
    text = str(info.value)
    assert "exited with code 3" in text and "reader exploded on line 7" in text
    assert "would fail the same way" in text and "run the same command again" not in text


def test_a_worker_exception_is_raised_as_itself_with_its_traceback(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(InputError) as info:
        prepare([str(tmp_path / "in")], out=tmp_path / "s", workers=2, progress=False)
    assert info.value.reason == "malformed_json" and ":2" in str(info.value)
    assert "Traceback" in str(info.value.__cause__)


RUN_PREPARE = """
import json, sys
from tokenmill import prepare
a = json.loads(sys.argv[1])
prepare(a.pop("inputs"), progress=a.pop("progress", False), **a)
"""


def _script(tmp_path: Path, inputs, cwd=None, wait=True, **args):
    """prepare(...) in a fresh process started from a script file; waits unless told not to."""
    script = tmp_path / "run_prepare.py"
    script.write_text(RUN_PREPARE)
    cmd = [sys.executable, str(script), json.dumps({"inputs": inputs, **args})]
    if not wait:
        return subprocess.Popen(cmd, stderr=subprocess.DEVNULL, cwd=cwd)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_path_spellings_are_one_input_and_other_settings_say_what_differs(tmp_path, real_texts):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "x.jsonl", real_texts[:400])
    spellings = ["./in/x.jsonl", "in/x.jsonl", str(tmp_path / "in" / "x.jsonl")]
    opts = dict(out="store", workers=1, shard_tokens=20_000, unit_bytes=20_000)
    kill_after_first_commit(_script(tmp_path, [spellings[0]], tmp_path, wait=False, **opts),
                             tmp_path / "store")
    done = _script(tmp_path, [spellings[1]], tmp_path, **opts)  # resumes the other spelling's run
    assert done.returncode == 0, done.stderr
    ref = _script(tmp_path, [spellings[2]], tmp_path, **{**opts, "out": "ref"})
    assert ref.returncode == 0 and store_bytes(tmp_path / "store") == store_bytes(tmp_path / "ref")
    for spelling in spellings:
        again = _script(tmp_path, [spelling], tmp_path, progress=None, **opts)
        assert again.returncode == 0 and "already complete" in again.stderr, again.stderr
    other = _script(tmp_path, [spellings[1]], tmp_path, **{**opts, "shard_tokens": 7000})
    assert other.returncode != 0 and "shard_tokens: 20000 → 7000" in other.stderr, other.stderr


def test_an_unfinished_run_with_other_settings_says_what_differs(tmp_path, real_texts):
    write_jsonl(tmp_path / "x.jsonl", real_texts[:400])
    opts = dict(out="store", workers=1, shard_tokens=20_000, unit_bytes=20_000)
    kill_after_first_commit(_script(tmp_path, ["x.jsonl"], tmp_path, wait=False, **opts),
                             tmp_path / "store")
    other = _script(tmp_path, ["x.jsonl"], tmp_path, **{**opts, "shard_tokens": 30_000})
    assert other.returncode != 0 and "unfinished" in other.stderr
    assert "shard_tokens: 20000 → 30000" in other.stderr, other.stderr
    write_jsonl(tmp_path / "x.jsonl", real_texts[:400] + ["one more"])  # another size: named
    other = _script(tmp_path, ["x.jsonl"], tmp_path, **opts)
    assert other.returncode != 0 and "x.jsonl:" in other.stderr and " bytes" in other.stderr


def test_the_manifest_and_messages_never_hold_credentials(tmp_path):
    import http.server
    import threading
    write_jsonl(tmp_path / "c.jsonl", ["served over http"])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://ann:hunter2@127.0.0.1:{server.server_address[1]}/c.jsonl"
        m = prepare([url], out=tmp_path / "s", workers=1, progress=False)
    finally:
        server.shutdown()
    text = (tmp_path / "s" / "manifest.json").read_text()
    assert docs_of(tmp_path / "s") == [byte_ids("served over http")]
    assert "hunter2" not in text and "ann:***@" in text
    assert "hunter2" not in json.dumps(m)


def test_a_resume_says_which_input_changed_under_the_same_size_and_mtime(tmp_path, real_texts):
    x = write_jsonl(tmp_path / "x.jsonl", real_texts[:400])
    opts = dict(out="store", workers=1, shard_tokens=20_000, unit_bytes=20_000)
    kill_after_first_commit(_script(tmp_path, ["x.jsonl"], tmp_path, wait=False, **opts),
                             tmp_path / "store")
    stat, data = x.stat(), x.read_bytes()
    assert b"the " in data[:20_000]
    x.write_bytes(data[:20_000].replace(b"the ", b"THE ") + data[20_000:])
    os.utime(x, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rerun = _script(tmp_path, ["x.jsonl"], tmp_path, progress=None, **opts)
    assert rerun.returncode == 0, rerun.stderr
    assert "note: x.jsonl changed since the interrupted run" in rerun.stderr, rerun.stderr
    fresh = _script(tmp_path, ["x.jsonl"], tmp_path, **{**opts, "out": "fresh"})
    assert fresh.returncode == 0 and store_bytes(tmp_path / "store") == store_bytes(
        tmp_path / "fresh")


LEASE_HOLDER = """
import sys, time
from tokenmill.store.upload import RemoteOut
from tokenmill.store.writer import StoreWriter, WriterConfig
remote = RemoteOut(sys.argv[1])
w = StoreWriter(remote.staging, WriterConfig("uint16", 100, {"settings": {}}), remote=remote)
print("leased", flush=True)
time.sleep(60)
"""


def test_a_url_output_written_from_another_machine_is_refused_by_its_lease(tmp_path,
                                                                            monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", ["abc"])
    url = f"file://{tmp_path}/bucket/store"
    script = tmp_path / "lease_holder.py"
    script.write_text(LEASE_HOLDER)
    other_machine = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache-a")}
    holder = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE,
                              text=True, env=other_machine)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache-b"))  # its own staging
    try:
        assert holder.stdout.readline().strip() == "leased"
        with pytest.raises(ConcurrentWriterError, match=f"pid {holder.pid} on ") as info:
            prepare([str(tmp_path / "c.jsonl")], out=url, workers=1, progress=False)
        assert info.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    lease = tmp_path / "bucket" / "store" / ".lease.json"
    data = json.loads(lease.read_text())  # left by the killed holder; on another node, live:
    lease.write_text(json.dumps({**data, "host": "node-7", "expires": time.time() + 60}))
    with pytest.raises(ConcurrentWriterError, match=f"pid {holder.pid} on node-7"):
        prepare([str(tmp_path / "c.jsonl")], out=url, workers=1, progress=False)
    lease.write_text(json.dumps({**data, "host": "node-7", "expires": time.time() - 1}))
    prepare([str(tmp_path / "c.jsonl")], out=url, workers=1, progress=False)  # expired: ours
    assert verify_store(tmp_path / "bucket" / "store") == [] and not lease.exists()


def test_the_lease_of_a_killed_writer_on_this_machine_is_taken_at_once(tmp_path, monkeypatch):
    """A writer killed on this machine never releases its lease; the next prepare takes it over
    at once (its pid no longer runs), also while the killed one is not yet reaped (a zombie:
    exited, its pid still listed)."""
    write_jsonl(tmp_path / "c.jsonl", ["abc"])
    url = f"file://{tmp_path}/bucket/store"
    script = tmp_path / "lease_holder.py"
    script.write_text(LEASE_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE,
                              text=True, env={**os.environ,
                                              "TOKENMILL_CACHE_DIR": str(tmp_path / "cache-a")})
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache-b"))
    try:
        assert holder.stdout.readline().strip() == "leased"
        holder.kill()
        stat = Path(f"/proc/{holder.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # killed, not reaped
            time.sleep(0.01)
        lease = json.loads((tmp_path / "bucket" / "store" / ".lease.json").read_text())
        assert lease["pid"] == holder.pid and lease["expires"] > time.time()  # still live
        prepare([str(tmp_path / "c.jsonl")], out=url, workers=1, progress=False)
    finally:
        holder.kill()
        holder.wait()
    assert verify_store(tmp_path / "bucket" / "store") == []


def test_a_folder_input_says_which_files_it_ignored_by_extension(tmp_path):
    """issue 12.13: files prepare cannot read are counted by extension, never passed over silently."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (src / "README.md").write_text("# notes\n")
    (src / "data.xml").write_text("<a/>\n")
    (src / "extra.xml").write_text("<b/>\n")
    cli = Path(sys.executable).with_name("tokenmill")
    proc = subprocess.run([str(cli), "prepare", str(src), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "ignored 3 files: 2 .xml, 1 .md" in proc.stderr, proc.stderr
    assert "done: 1 documents" in proc.stderr
    assert "Traceback" not in proc.stderr
