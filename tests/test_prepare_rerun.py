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


def tokenmill(cwd, *args, env=None):
    """``python -m tokenmill ARGS`` in a fresh process: (exit code, stderr)."""
    done = subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def one_line_refusal(code, err):
    """The one line of a refusal (exit 2, no traceback)."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    return lines[-1]


def test_a_file_url_input_rewritten_under_the_same_size_and_mtime_is_refused(tmp_path):
    # before: a file:// input was recorded as a URL whose only version is its mtime, so this
    # rerun said "already complete" and kept the store made from the old text
    corpus(tmp_path)
    url = (tmp_path / "x.jsonl").as_uri()
    args = ["prepare", url, "--out", "store", "--tokenizer", "bytes", "--shard-tokens", "20000"]
    assert tokenmill(tmp_path, *args, "--quiet") == (0, "")
    before = store_bytes(tmp_path / "store")
    code, err = tokenmill(tmp_path, *args)
    assert code == 0 and "already complete" in err, err
    rewrite_keeping_size_and_mtime(tmp_path / "x.jsonl")
    line = one_line_refusal(*tokenmill(tmp_path, *args))
    assert url in line and "same size and modification time, other bytes" in line, line
    assert "--overwrite" in line, line
    assert store_bytes(tmp_path / "store") == before


def test_a_url_whose_server_reports_only_a_time_is_confirmed_by_its_bytes(tmp_path):
    # python's http.server sends Last-Modified (seconds) and no ETag: before, a same-size edit
    # kept under the same time left the rerun "already complete" on the old text
    import functools
    import http.server
    import threading
    (tmp_path / "srv").mkdir()
    corpus(tmp_path / "srv")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(tmp_path / "srv"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/x.jsonl"
        args = ["prepare", url, "--out", "store", "--tokenizer", "bytes"]
        assert tokenmill(tmp_path, *args, "--quiet") == (0, "")
        before = store_bytes(tmp_path / "store")
        code, err = tokenmill(tmp_path, *args)
        assert code == 0 and "already complete" in err, err  # the same bytes: kept
        rewrite_keeping_size_and_mtime(tmp_path / "srv" / "x.jsonl")
        line = one_line_refusal(*tokenmill(tmp_path, *args))
    finally:
        server.shutdown()
    assert url in line and "same size and Last-Modified, other bytes" in line, line
    assert store_bytes(tmp_path / "store") == before


def test_a_rerun_names_the_input_that_grew_and_the_file_added_or_removed(tmp_path):
    # before: "already holds a store prepared with other settings (the input files' names or
    # sizes changed; …)", naming no file and no size
    (tmp_path / "d").mkdir()
    corpus(tmp_path / "d")
    args = ["prepare", "d", "--out", "store", "--tokenizer", "bytes", "--shard-tokens", "20000"]
    assert tokenmill(tmp_path, *args, "--quiet") == (0, "")
    before = store_bytes(tmp_path / "store")
    x = tmp_path / "d" / "x.jsonl"
    size = x.stat().st_size
    with open(x, "a") as f:
        f.write('{"text": "one more"}\n')
    line = one_line_refusal(*tokenmill(tmp_path, *args))
    assert f"another version of d/x.jsonl (size {size:,} → {size + 21:,} bytes)" in line, line
    assert "y.txt" not in line and "--overwrite" in line and "another --out" in line, line
    x.write_bytes(x.read_bytes()[:size])
    (tmp_path / "d" / "z.txt").write_text("a file added to the folder")
    line = one_line_refusal(*tokenmill(tmp_path, *args))
    assert "other input files (added: d/z.txt)" in line and "--overwrite" in line, line
    (tmp_path / "d" / "z.txt").unlink()
    (tmp_path / "d" / "y.txt").unlink()
    line = one_line_refusal(*tokenmill(tmp_path, *args))
    assert f"other input files (removed: {tmp_path / 'd' / 'y.txt'})" in line, line
    assert store_bytes(tmp_path / "store") == before


def test_a_rerun_with_a_transform_and_a_split_names_the_changed_input(tmp_path):
    # the edit changes the transform's sample records, a setting: before, the refusal showed two
    # transform identities and never named x.jsonl
    corpus(tmp_path)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "bang.py").write_text("def bang(r):\n    return r['text'] + '!'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")])}
    args = ["prepare", "x.jsonl", "--out", "out", "--tokenizer", "bytes", "--transform",
            "bang:bang", "--val-fraction", "0.2"]
    assert tokenmill(tmp_path, *args, "--quiet", env=env) == (0, "")
    rewrite_keeping_size_and_mtime(tmp_path / "x.jsonl", 0)  # in the first records
    line = one_line_refusal(*tokenmill(tmp_path, *args, env=env))
    assert "another version of x.jsonl (same size and modification time, other bytes)" in line
    assert "transform" not in line and "--overwrite" in line, line


def test_out_a_fifo_or_a_dangling_link_says_what_it_is(tmp_path):
    # before: "ff: File exists; the output must be a folder to write in" for both
    corpus(tmp_path)
    os.mkfifo(tmp_path / "ff")
    os.symlink("nowhere", tmp_path / "dl")
    args = ["prepare", "x.jsonl", "--tokenizer", "bytes", "--out"]
    line = one_line_refusal(*tokenmill(tmp_path, *args, "ff"))
    assert line.endswith("ff: is a named pipe (FIFO), not a folder; the output must be a folder "
                         "to write in: move it away, or choose another --out"), line
    line = one_line_refusal(*tokenmill(tmp_path, *args, "dl"))
    assert line.endswith("dl: is a symbolic link to nowhere, which does not exist; the output "
                         "must be a folder to write in: create the folder it points to, or "
                         "choose another --out"), line
    assert os.readlink(tmp_path / "dl") == "nowhere" and not (tmp_path / "nowhere").exists()
