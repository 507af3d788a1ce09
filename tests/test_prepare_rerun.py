"""A rerun of prepare on a finished store (issue 22): an input rewritten since under the same size
and mtime is refused, naming it; a touch or chmod is no change; an unchanged rerun reads no input.

Each run is ``python -m tokenmill prepare`` in a fresh process, on real files; an audit hook in
that process lists every file it opens, so "reads no input" is a count, not a time."""

import json
import os
import subprocess
import sys
import time

from conftest import stdlib_texts, store_bytes, write_jsonl

HOOKED = """
import atexit, json, os, runpy, sys
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        opened.append(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
log = sys.argv.pop(1)
atexit.register(lambda: open(log, "w").write(json.dumps(opened)))
sys.argv[0] = "tokenmill"
runpy.run_module("tokenmill", run_name="__main__")
"""


def prepare(tmp_path, *args):
    """``tokenmill prepare x.jsonl y.txt --out store …`` in a fresh process: (exit code, stderr,
    the input files it opened)."""
    log = tmp_path / "opened.json"
    argv = [sys.executable, "-c", HOOKED, str(log), "prepare", "x.jsonl", "y.txt", "--out",
            "store", "--tokenizer", "bytes", "--workers", "2", "--shard-tokens", "20000", *args]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    inputs = {str(tmp_path / "x.jsonl"), str(tmp_path / "y.txt")}
    opened = sorted(os.path.basename(f) for f in json.loads(log.read_text()) if f in inputs)
    return done.returncode, done.stderr, opened


def corpus(tmp_path):
    texts = [p for t in stdlib_texts(120_000) for p in t.split("\n\n") if p.strip()]
    write_jsonl(tmp_path / "x.jsonl", texts[:300])
    (tmp_path / "y.txt").write_text("\n\n".join(texts[300:400]))


def rewrite_keeping_size_and_mtime(path, at=None):
    """An edit as tools make it, then ``touch -r``: one word in capitals (the first " the " from
    ``at``, else from the middle), size and mtime kept."""
    st, data = path.stat(), path.read_bytes()
    at = data.index(b" the ", len(data) // 2 if at is None else at)
    path.write_bytes(data[:at] + b" THE " + data[at + 5:])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_finished_store_whose_input_was_rewritten_under_the_same_size_and_mtime_is_refused(
        tmp_path):
    corpus(tmp_path)
    code, err, _ = prepare(tmp_path, "--quiet")
    assert code == 0, err
    before = store_bytes(tmp_path / "store")
    rewrite_keeping_size_and_mtime(tmp_path / "x.jsonl")
    code, err, opened = prepare(tmp_path)
    # before: exit 0, "store: already complete", the store made from the old text kept
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "x.jsonl" in lines[0] and "same size and modification time, other bytes" in lines[0]
    assert "--overwrite" in lines[0] and "y.txt" not in lines[0], lines[0]
    assert store_bytes(tmp_path / "store") == before  # refused: nothing touched
    assert opened == ["x.jsonl"]  # its identity differs (ctime): its bytes compared; y.txt not
    code, err, _ = prepare(tmp_path, "--quiet", "--overwrite")
    assert code == 0, err
    os.rename(tmp_path / "store", tmp_path / "redone")
    code, err, _ = prepare(tmp_path, "--quiet")  # a fresh store from the files as they are now
    assert code == 0, err
    assert store_bytes(tmp_path / "redone") != before
    assert store_bytes(tmp_path / "redone") == store_bytes(tmp_path / "store")


def test_a_touch_or_chmod_is_no_change_and_an_unchanged_rerun_reads_no_input(tmp_path):
    corpus(tmp_path)
    code, err, _ = prepare(tmp_path, "--quiet")
    assert code == 0, err
    before = store_bytes(tmp_path / "store")
    code, err, opened = prepare(tmp_path)
    assert code == 0 and "already complete" in err, err
    assert opened == []  # nothing read: every input's identity is the recorded one
    os.utime(tmp_path / "x.jsonl")  # touch: a new mtime (and ctime), the same bytes
    os.chmod(tmp_path / "y.txt", 0o600)  # a new ctime
    code, err, opened = prepare(tmp_path)
    assert code == 0 and "already complete" in err, err
    assert opened == ["x.jsonl", "y.txt"]  # their bytes compared, once each
    assert store_bytes(tmp_path / "store") == before  # kept, not rebuilt


GATE = '''
"""A transform that stops at the record marked "gate" until the test says go."""
import os
import time


def gate(record):
    if record.get("gate"):
        open(os.path.join(os.environ["GATE_DIR"], "waiting"), "w").close()
        while not os.path.exists(os.path.join(os.environ["GATE_DIR"], "go")):
            time.sleep(0.01)
    return record["text"]
'''


def test_an_input_rewritten_under_the_same_size_and_mtime_while_prepare_runs_fails_the_run(
        tmp_path):
    # the rewrite lands after prepare read the words it changes and before it finishes: the
    # identity each unit is read under (inode, size, mtime) never changed, so before, the run
    # finished (exit 0) with the old text, and every rerun called that store complete
    texts = [p for t in stdlib_texts(200_000) for p in t.split("\n\n") if p.strip()][:600]
    rows = [{"text": t, **({"gate": True} if i == 500 else {})} for i, t in enumerate(texts)]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "gated.py").write_text(GATE)
    env = {**os.environ, "GATE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "tokenmill", "prepare", "x.jsonl", "--tokenizer", "bytes",
            "--transform", "gated:gate", "--workers", "1", "--shard-tokens", "20000", "--quiet"]
    run = subprocess.Popen([*argv, "--out", "store"], cwd=tmp_path, env=env, text=True,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120  # a hang guard only: the gate is a file, not a time
        while not (tmp_path / "waiting").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
            time.sleep(0.01)
        at = (tmp_path / "x.jsonl").read_bytes().index(b" the ", 20_000)  # record ~100 of 600
        rewrite_keeping_size_and_mtime(tmp_path / "x.jsonl", at)
        (tmp_path / "go").touch()
        err = run.communicate(timeout=300)[1]
    finally:
        run.kill()
    assert run.returncode == 2, err
    assert err.count("\n") == 1 and "x.jsonl: the file changed while it was being read" in err
    assert not (tmp_path / "store" / "manifest.json").exists()
    done = subprocess.run([*argv, "--out", "store"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # resumes: the changed shards are redone
    assert done.returncode == 0, done.stderr
    fresh = subprocess.run([*argv, "--out", "fresh"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    assert store_bytes(tmp_path / "store") == store_bytes(tmp_path / "fresh")
