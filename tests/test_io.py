"""The I/O layer: redaction, file locks between real processes, atomic writes, sizes, checksums
watched in the background; and credentials in an input URL, end to end, against a real HTTP
server on 127.0.0.1 that demands them (issue 12.8)."""

import base64
import functools
import http.server
import json
import os
import pty
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

import tokenmill
from conftest import write_jsonl
from tokenmill.base.errors import ConfigError, StoreError, TokenmillError
from tokenmill.base.io import (BackgroundJobs, ChecksumWatch, atomic_output, atomic_write_bytes,
                               atomic_write_json, file_size, filesystem, is_url, lock_file,
                               open_binary, parse_bytes, redact, unlock, xxh3_file)
from tokenmill.store import TokenStore

TOKENMILL = Path(sys.executable).with_name("tokenmill")

# ---- redact -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("http://ann:pw@host/a.jsonl", "http://ann:***@host/a.jsonl"),
    ("s3://key:se/cr@bucket/x", "s3://key:se/cr@bucket/x"),  # '/' ends the authority: no password
    ("fetch https://ann:p%40ss@h:8080/a?token=t0k&x=1 failed",
     "fetch https://ann:***@h:8080/a?token=***&x=1 failed"),
    ("a=http://u:1@a/x b='gs://v:2@b/y'", "a=http://u:***@a/x b='gs://v:***@b/y'"),
    ("https://h/o?X-Amz-Signature=abc&X-Amz-Credential=k%2F1&part=2",
     "https://h/o?X-Amz-Signature=***&X-Amz-Credential=***&part=2"),
    ("https://h/o?sig=s&api_key=k&key=v&keys=1",
     "https://h/o?sig=***&api_key=***&key=***&keys=***"),
    ("data/shard-00001.bin: expected 60 bytes", "data/shard-00001.bin: expected 60 bytes"),
    ("http://host/a.jsonl (no credentials)", "http://host/a.jsonl (no credentials)"),
    ("user@example.com wrote ratio=3", "user@example.com wrote ratio=3"),
    # the value stops where the URL does: text after it in a message survives
    ("cannot read (http://h/x.jsonl?token=abc): no file", "cannot read (http://h/x.jsonl?token=***): no file"),
    ("http://h/x.jsonl?token=a:b: no file matched", "http://h/x.jsonl?token=***: no file matched"),
    ("[http://h/x?key=k1] and <http://h/y?sig=s2>, then http://h/z?auth=a;x=1",
     "[http://h/x?key=***] and <http://h/y?sig=***>, then http://h/z?auth=***;x=1"),
    ("'http://h/x?token=t' \"http://h/y?token=u\" http://h/z?token=v#frag",
     "'http://h/x?token=***' \"http://h/y?token=***\" http://h/z?token=***#frag"),
])
def test_redact(text, want):
    assert redact(text) == want
    assert redact(want) == want  # idempotent: redacting twice changes nothing more
    assert redact(Path("a/b")) == "a/b"


def test_is_url_and_filesystem():
    assert is_url("s3://b/x") and is_url("memory://x")
    assert not is_url("store/") and not is_url(Path("/tmp/x"))
    with pytest.raises(ConfigError, match=r"sftp://ann:\*\*\*@h/x: cannot open .*install"):
        filesystem("sftp://ann:pw@h/x")  # paramiko is not installed: say what to install
    fs, path = filesystem("memory://tm-io/a.txt")
    fs.pipe_file(path, b"hello\nworld\n")
    assert file_size("memory://tm-io/a.txt") == 12
    with open_binary("memory://tm-io/a.txt") as f:
        assert f.readline(3) == b"hel" and f.read() == b"lo\nworld\n"


def test_parse_bytes():
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("16GiB") == 16 << 30
    assert parse_bytes(" 1.5k ") == 1536 and parse_bytes(7) == 7
    for bad in ("lots", "0", -1, True):
        with pytest.raises(ConfigError, match="cache size must"):
            parse_bytes(bad, what="cache size")


# ---- writing and checksums ----------------------------------------------------------------------


def test_atomic_writes_leave_no_temporary_file(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "m.json").read_text() == '{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}\n'
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "m.json", {"x": object()})
    assert os.listdir(tmp_path) == ["m.json"]  # the old file stands, nothing else was left
    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "m.json") as f:
            f.write(b"half a file")
            raise RuntimeError("the writer failed")
    assert os.listdir(tmp_path) == ["m.json"] and (tmp_path / "m.json").read_bytes()[:1] == b"{"
    atomic_write_bytes(tmp_path / "b", b"\x00" * 10)
    assert xxh3_file(tmp_path / "b") == xxhash.xxh3_64_hexdigest(b"\x00" * 10)
    cancel = threading.Event()
    cancel.set()
    assert xxh3_file(tmp_path / "b", cancel) is None


def test_checksum_watch_checks_each_file_once_per_process(tmp_path):
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    good.write_bytes(b"a" * 1000)
    bad.write_bytes(b"b" * 1000)
    watch = ChecksumWatch(hint="; run verify")
    watch.add(good, xxhash.xxh3_64_hexdigest(b"a" * 1000))
    watch.wait()
    assert watch.failure is None
    watch.add(bad, xxhash.xxh3_64_hexdigest(b"a" * 1000))
    watch.wait()
    assert watch.failure.startswith(f"{bad}: checksum mismatch")
    assert watch.failure.endswith("; run verify")
    again = ChecksumWatch()
    again.add(bad, xxhash.xxh3_64_hexdigest(b"a" * 1000))
    assert again.failure is not None  # known in this process: no second pass over the file
    off = ChecksumWatch(enabled=False)
    off.add(bad, "0" * 16)
    off.wait()
    assert off.failure is None
    for w in (watch, again, off):
        w.close()


def test_background_jobs_run_in_order_and_close_cancels_the_rest():
    jobs = BackgroundJobs("test-jobs")
    gate, seen = threading.Event(), []
    first = jobs.submit(lambda cancel: (gate.wait(5), seen.append(1)))
    later = [jobs.submit(lambda cancel, i=i: seen.append(i)) for i in (2, 3)]
    time.sleep(0.05)
    jobs.close(wait=0)
    gate.set()
    jobs.join(5)
    assert first.done() and all(f.cancelled() for f in later) and seen == [1]
    assert jobs.submit(lambda cancel: None).cancelled()


# ---- file locks, between real processes ---------------------------------------------------------

HOLD_LOCK = """
import sys, time
from tokenmill.base.io import lock_file
fd = lock_file(sys.argv[1], exclusive=sys.argv[2] == "ex")
print("locked", flush=True)
time.sleep(600)
"""


def hold(tmp_path: Path, path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "hold_lock.py"
    script.write_text(HOLD_LOCK)
    p = subprocess.Popen([sys.executable, str(script), str(path), mode], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_lock_file_between_processes(tmp_path):
    path = tmp_path / ".lock"
    holder = hold(tmp_path, path, "ex")
    try:
        assert lock_file(path, wait=False) is None
        assert lock_file(path, exclusive=False, wait=False) is None
    finally:
        holder.kill()
        holder.wait()
    fd = lock_file(path, wait=False)  # the kernel dropped the dead holder's lock
    assert fd is not None
    unlock(fd)
    reader = hold(tmp_path, path, "sh")
    try:
        shared = lock_file(path, exclusive=False, wait=False)
        assert shared is not None and lock_file(path, wait=False) is None
        unlock(shared)
    finally:
        reader.kill()
        reader.wait()


# ---- credentials in URLs: a real HTTP server that demands them (issue 12.8) ---------------------

SECRET = "s3cr3t-pw"


class AuthHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder to the one user ann:SECRET (401 to anyone else)."""

    def authorised(self) -> bool:
        want = "Basic " + base64.b64encode(f"ann:{SECRET}".encode()).decode()
        if self.headers.get("Authorization") == want:
            return True
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="data"')
        self.end_headers()
        return False

    def do_GET(self):
        if self.authorised():
            super().do_GET()

    def do_HEAD(self):
        if self.authorised():
            super().do_HEAD()

    def log_message(self, *args):
        pass


@pytest.fixture()
def data_server(tmp_path):
    """``http://ann:SECRET@127.0.0.1:PORT`` serving ``tmp_path/www`` (c.jsonl in it)."""
    www = tmp_path / "www"
    www.mkdir()
    write_jsonl(www / "c.jsonl", [f"document {i} " + "word " * (i % 50 + 5) for i in range(300)])
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(AuthHandler, directory=str(www)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://ann:{SECRET}@127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def run_in_terminal(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """Run a command with a pseudo-terminal as stdout and stderr (so progress bars show); its
    exit code and everything it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    leader, follower = pty.openpty()
    p = subprocess.Popen(args, cwd=cwd, stdin=subprocess.DEVNULL, stdout=follower,
                         stderr=follower, env=env)
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command is done
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    os.close(leader)
    return p.wait(timeout=10), out.decode(errors="replace")


def test_credentials_in_an_input_url_are_used_and_never_written_or_shown(data_server, tmp_path):
    url = f"{data_server}/c.jsonl"
    code, shown = run_in_terminal([str(TOKENMILL), "prepare", url, "--out", "store",
                                   "--workers", "1"], tmp_path)
    assert code == 0, shown
    assert SECRET not in shown and "done: 300 documents" in shown
    manifest = (tmp_path / "store" / "manifest.json").read_text()
    assert SECRET not in manifest
    assert url.replace(SECRET, "***") in manifest  # the input is recorded, its password is not
    # the same command again: the redacted record still says "this very store"
    code, shown = run_in_terminal([str(TOKENMILL), "prepare", url, "--out", "store",
                                   "--workers", "1"], tmp_path)
    assert code == 0 and "already complete" in shown and SECRET not in shown
    for args in (["inspect", "store"], ["verify", "store"]):
        code, shown = run_in_terminal([str(TOKENMILL), *args], tmp_path)
        assert code == 0 and SECRET not in shown


def test_errors_about_a_url_with_credentials_never_show_them(data_server, tmp_path):
    missing = f"{data_server}/missing.jsonl"
    code, shown = run_in_terminal([str(TOKENMILL), "prepare", missing, "--out", "s1",
                                   "--workers", "1"], tmp_path)
    assert code != 0 and "missing.jsonl" in shown and SECRET not in shown
    assert "Traceback" not in shown
    failures = {
        "missing store": lambda: TokenStore(f"{data_server}/nostore", cache_dir=tmp_path / "c"),
        "unwritable out": lambda: tokenmill.prepare(f"{data_server}/c.jsonl",
                                                    out=f"{data_server}/out", workers=1,
                                                    progress=False),
        "missing input": lambda: tokenmill.prepare(missing, out=tmp_path / "s2", workers=1,
                                                   progress=False),
    }
    for what, call in failures.items():
        with pytest.raises(TokenmillError) as e:
            call()
        assert SECRET not in str(e.value), f"{what}: {e.value}"
        assert "ann:***@127.0.0.1" in str(e.value), f"{what}: {e.value}"
    with pytest.raises(StoreError):
        TokenStore(f"{data_server}/nostore", cache_dir=tmp_path / "c")
    assert json.dumps(tokenmill.verify_store(f"{data_server}/nostore")).count(SECRET) == 0


def test_a_signed_url_with_a_query_is_one_file_named_by_its_path(data_server, tmp_path):
    # the server ignores the query, as a signed-URL endpoint checks it and serves the path
    url = f"{data_server}/c.jsonl?token=t0k3n-2&X-Amz-Expires=60"
    code, shown = run_in_terminal([str(TOKENMILL), "prepare", url, "--out", "store",
                                   "--workers", "1"], tmp_path)
    assert code == 0, shown
    assert "done: 300 documents" in shown and SECRET not in shown and "t0k3n-2" not in shown
    manifest = (tmp_path / "store" / "manifest.json").read_text()
    assert "t0k3n-2" not in manifest and SECRET not in manifest
    assert "c.jsonl?token=***" in manifest


def test_an_input_url_whose_host_cannot_be_reached_says_so(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://ann:{SECRET}@127.0.0.1:{port}/c.jsonl?token=t0k3n-3"
    code, shown = run_in_terminal([str(TOKENMILL), "prepare", url, "--out", "store",
                                   "--workers", "1"], tmp_path)
    assert code == 2 and "Traceback" not in shown
    assert f"http://ann:***@127.0.0.1:{port}/c.jsonl?token=***: cannot reach its host" in shown
    assert "no file matched" not in shown and SECRET not in shown and "t0k3n-3" not in shown


def test_a_store_on_a_plain_http_server_whose_listing_has_no_sizes_reads_and_verifies(
        data_server, tmp_path):
    # http.server's index page lists names only: sizes come from a HEAD per file
    www = tmp_path / "www"
    tokenmill.prepare(www / "c.jsonl", out=www / "store", workers=1, progress=False)
    fs, root = filesystem(f"{data_server}/store")
    assert {i["size"] for i in fs.ls(root, detail=True)} == {None}  # the listing has no sizes
    for args in (["verify", f"{data_server}/store"], ["inspect", f"{data_server}/store"]):
        code, shown = run_in_terminal([str(TOKENMILL), *args], tmp_path)
        assert code == 0 and "found 0" not in shown and SECRET not in shown, shown
    code, shown = run_in_terminal([str(TOKENMILL), "verify", f"{data_server}/store"], tmp_path)
    assert "OK (structure and every checksum verified)" in shown
    with TokenStore(f"{data_server}/store", cache_dir=tmp_path / "cache") as remote, \
            TokenStore(www / "store") as local:
        assert remote.num_tokens == local.num_tokens > 0
