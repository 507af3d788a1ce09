"""Input files that change while prepare reads them, and files that are not regular files.

Real prepare processes (the CLI, or a script file as a user writes one) on real files. A run is
stopped at a known record by a transform that waits there (it touches ``paused`` and waits for
``go``), the input is changed, and the run goes on: it must fail naming the file, and write no
manifest — never a store holding part of one version and part of another.

Not regular files: a FIFO, a socket or a device is never opened as an input (a FIFO blocks its
reader for ever); an output path holding a link, a FIFO, a device or a folder is refused, never
replaced nor written through. Every such run has a timeout: a hang fails the test.
"""

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import docs_of, write_jsonl
from tokenmill.inputs import sources
from tokenmill.base.errors import ConfigError, InputError
from tokenmill.base.io import atomic_write_bytes
from tokenmill.prepare import prepare
from tokenmill.inputs.records import SourceConfig

LINE = 100  # every record's line is exactly this long: record i starts at byte i * LINE
UNIT = 4000  # unit_bytes of the script runs: 40 records a unit
PAUSE_AT = 12 * UNIT // LINE + 5  # a record of unit 12: past the 9 units a read-ahead thread
#                                   may read before the run has planned (so its plan is in place)

HOOK = '''
import os
import time
from pathlib import Path


def pause(record):
    """The record's text; at record PAUSE_AT (once): touch "paused", wait for "go"."""
    here = Path(os.environ["PAUSE_DIR"])
    if record["i"] == int(os.environ["PAUSE_AT"]) and not (here / "go").exists():
        (here / "paused").touch()
        deadline = time.monotonic() + 120
        while not (here / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never said go")
            time.sleep(0.001)
    return record["text"]
'''

RUN_PREPARE = """
import json, sys
from tokenmill import prepare
prepare(sys.argv[1], progress=False, **json.loads(sys.argv[2]))
"""


def records(n: int, fill: str = "x") -> bytes:
    """n JSONL records of exactly LINE bytes each: {"i": i, "text": "<i> xxx…"}."""
    out = []
    for i in range(n):
        head = json.dumps({"i": i, "text": f"{i:06d} "})[:-2]
        out.append(f'{head}{fill * (LINE - len(head) - 3)}"}}\n')
    data = "".join(out).encode()
    assert len(data) == n * LINE
    return data


@pytest.fixture
def site(tmp_path):
    """A working folder: the pausing transform in mods/, x.jsonl of 1,200 records (30 units)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hook.py").write_text(HOOK)
    (tmp_path / "run_prepare.py").write_text(RUN_PREPARE)
    (tmp_path / "x.jsonl").write_bytes(records(1200))
    return tmp_path


def env_of(site: Path) -> dict:
    """The environment of a run in ``site``: the hook importable, where and when it pauses."""
    path = os.pathsep.join([str(site / "mods"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PAUSE_DIR": str(site),
            "PAUSE_AT": str(PAUSE_AT)}


def paused_run(site: Path, argv: list[str], change) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``site``; once it waits at record PAUSE_AT, ``change(site / "x.jsonl")``,
    then let it go on; its result."""
    proc = subprocess.Popen(argv, cwd=site, env=env_of(site), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (site / "paused").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached the record"
            time.sleep(0.002)
        change(site / "x.jsonl")
        (site / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def replaced(path: Path) -> None:
    """`mv new.jsonl x.jsonl`: other text of the very same size, renamed over the input."""
    new = path.with_name("new.jsonl")
    new.write_bytes(records(1200, fill="N"))
    os.replace(new, path)


def truncated(path: Path) -> None:
    """The input cut in place at 60 %, inside a line (a job rewriting it)."""
    os.truncate(path, 720 * LINE + 37)


def script(workers: int, inputs: str = "x.jsonl") -> list[str]:
    """prepare(inputs, …) run by a script file: small units, the pausing transform."""
    options = {"out": "store", "workers": workers, "unit_bytes": UNIT, "shard_tokens": 2000,
               "transform": "hook:pause"}
    return [sys.executable, "run_prepare.py", inputs, json.dumps(options)]


CHANGED = "x.jsonl: the file changed while it was being read (replaced, truncated or rewritten: "


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("change, how", [(replaced, "another file was put in its place"),
                                         (truncated, "size 120,000 → 72,037 bytes")])
def test_an_input_changed_while_prepare_reads_it_fails_naming_it(site, workers, change, how):
    r = paused_run(site, script(workers), change)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"tokenmill.base.errors.InputError: {CHANGED}{how}); run again once it is stable"
    assert not (site / "store" / "manifest.json").exists()


def test_the_cli_says_in_one_line_which_input_changed(site):
    """`tokenmill prepare` with 2 workers (4 MiB units) over an input truncated mid-run."""
    (site / "x.jsonl").write_bytes(records(130_000))  # 13 MB: 4 units
    argv = [sys.executable, "-m", "tokenmill", "prepare", "x.jsonl", "--out", "store",
            "--workers", "2", "--transform", "hook:pause"]
    r = paused_run(site, argv, lambda p: os.truncate(p, 6_000_000 + 37))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"tokenmill prepare: error: {CHANGED}size 13,000,000 → "
                                     "6,000,037 bytes); run again once it is stable"]
    assert not (site / "store" / "manifest.json").exists()


def test_an_object_replaced_on_s3_while_prepare_reads_it_fails_naming_it(site, s3):
    """A URL's identity is its size and what the server reports of its version (here the ETag):
    checked after each unit is read."""
    url = s3.url("x.jsonl")
    s3.fs.pipe_file(url, records(1200))
    r = paused_run(site, script(2, url), lambda _: s3.fs.pipe_file(url, records(1200, "N")))
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf'tokenmill.base.errors.InputError: {url}: the file changed while it was '
                        r'being read \(replaced, truncated or rewritten: ETag "\w+" → "\w+"\); '
                        r'run again once it is stable', last), last
    assert not (site / "store" / "manifest.json").exists()


def replaced_at_its_time(path: Path) -> None:
    """`mv new.jsonl x.jsonl` of other text of the very same size and modification time
    (`touch -r x.jsonl new.jsonl` first): only the inode tells."""
    new, st = path.with_name("new.jsonl"), os.stat(path)
    new.write_bytes(records(1200, fill="N"))
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)


def test_an_input_replaced_at_its_own_size_and_time_is_caught_as_a_path_or_a_file_url(site):
    # before, as a file:// URL: its identity while read was fsspec's size and mtime (a URL's),
    # blind to the inode: the run went on to its end and only failed there, with another reason
    path = site / "x.jsonl"
    for name in (str(path), path.as_uri()):  # one identity, however the file is named
        path.write_bytes(records(1200))
        shutil.rmtree(site / "store", ignore_errors=True)
        for f in ("paused", "go"):
            (site / f).unlink(missing_ok=True)
        r = paused_run(site, script(2, name), replaced_at_its_time)
        assert r.returncode == 1, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last == (f"tokenmill.base.errors.InputError: {name}: the file changed while it "
                        "was being read (replaced, truncated or rewritten: another file was put "
                        "in its place); run again once it is stable"), name
        assert not (site / "store" / "manifest.json").exists()
        units = sources.plan_units([name], SourceConfig(unit_bytes=UNIT))
        replaced_at_its_time(path)  # after planning, before reading: not a byte is read
        with pytest.raises(InputError, match=re.escape(f"{name}: {CHANGED[9:]}another file")):
            next(sources.read_unit(units[0], SourceConfig(unit_bytes=UNIT)))


def rewritten(path: Path) -> None:
    """Other text of the same size written into the same file (same inode), mtime moved on."""
    before = os.stat(path).st_mtime_ns
    with open(path, "r+b") as f:
        f.write(records(1200, fill="N"))
    os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


@pytest.mark.parametrize("change, how", [
    (replaced, "another file was put in its place"), (truncated, "size 120,000 → 72,037 bytes"),
    (rewritten, "rewritten: same size, another mtime"), (os.remove, "removed")])
def test_every_change_after_planning_fails_each_unit_under_either_policy(tmp_path, change, how):
    """Without a transform too: each unit read after the change fails, naming the file."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(records(1200))
    units = sources.plan_units([str(path)], SourceConfig(unit_bytes=UNIT))
    change(path)
    for on_error in ("raise", "skip"):
        config = SourceConfig(unit_bytes=UNIT, on_error=on_error)
        for unit in (units[0], units[12], units[-1]):
            with pytest.raises(InputError, match=re.escape(f"{path}: {CHANGED[9:]}{how})")):
                list(sources.read_unit(unit, config))


def test_after_the_error_a_rerun_on_the_stable_file_gives_the_store_of_its_new_text(site):
    """The same command again gives the store of the file as it is now — here, where the run has
    a transform (the pause hook) whose identity hashes its output on the first records, which
    the replacement changed, the rerun refuses the unfinished run naming the transform's sample
    and --overwrite gives it (a transform's identity cannot tell a new input from a new
    transform: issue 22's classes 1 and 2 meet here)."""
    r = paused_run(site, script(2), replaced)
    assert r.returncode == 1 and list((site / "store" / ".progress").glob("shard-*.json"))
    rerun = subprocess.run(script(2), cwd=site, env=env_of(site), capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 1 and "sample records" in rerun.stderr, rerun.stderr
    rerun = subprocess.run([*script(2)[:-1], json.dumps({**json.loads(script(2)[-1]),
                                                         "overwrite": True})],
                           cwd=site, env=env_of(site), capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    fresh = prepare(str(site / "x.jsonl"), out=site / "fresh", workers=1, progress=False,
                    unit_bytes=UNIT, shard_tokens=2000)
    assert docs_of(site / "store") == docs_of(site / "fresh") and fresh["num_documents"] == 1200


def test_a_resume_after_a_size_change_is_refused_until_overwrite(site):
    """The file's size changed: the rerun refuses the unfinished run, saying so, until
    --overwrite; then it gives the store of the new text."""
    r = paused_run(site, script(2), truncated)
    assert r.returncode == 1 and list((site / "store" / ".progress").glob("shard-*.json"))
    (site / "x.jsonl").write_bytes(records(720))  # whole lines again: a valid, stable file
    rerun = subprocess.run(script(2), cwd=site, env=env_of(site), capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 1
    last = rerun.stderr.strip().splitlines()[-1]
    assert "holds an unfinished prepare with other settings (input files changed: " in last
    assert "x.jsonl: 120000 → 72000 bytes); an input changed since: pass --overwrite" in last
    assert not (site / "store" / "manifest.json").exists()
    over = subprocess.run([*script(2)[:-1], json.dumps({**json.loads(script(2)[-1]),
                                                        "overwrite": True})],
                          cwd=site, env=env_of(site), capture_output=True, text=True, timeout=120)
    assert over.returncode == 0, over.stderr
    assert [bytes(d[:-1]) for d in docs_of(site / "store")] == [
        json.loads(line)["text"].encode() for line in records(720).splitlines()]


# ---- files that are not regular files ----------------------------------------------------------

def tokenmill(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m tokenmill ARGS`` in ``cwd``; a hang past ``timeout`` fails the test."""
    return subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_fifo_or_socket_in_an_input_folder_is_passed_over_and_said(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", ["one", "two"])
    write_jsonl(tmp_path / "elsewhere.jsonl", ["three"])
    (data / "b.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")  # a link to a file is read
    os.mkfifo(data / "pipe.jsonl")  # opening it would wait for a writer for ever
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(data / "sock.txt"))
        r = tokenmill("prepare", "data", "--out", "store", "--workers", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ("note: ignored 2 files: 1 named pipe (FIFO), 1 socket (e.g. data/pipe.jsonl, "
            "data/sock.txt); prepare reads regular files of .txt") in r.stderr
    assert docs_of(tmp_path / "store") == [[*t.encode(), 256] for t in ("one", "two", "three")]


def test_a_fifo_named_as_an_input_is_refused_in_one_line(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    r = tokenmill("prepare", "pipe.jsonl", "--out", "store", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "tokenmill prepare: error: pipe.jsonl: is a named pipe (FIFO), not a regular file; "
        "tokenmill reads files: write its data to a file and name that"]


@pytest.fixture
def store(tmp_path) -> Path:
    """A small store to export."""
    write_jsonl(tmp_path / "x.jsonl", ["hello", "world"])
    prepare(str(tmp_path / "x.jsonl"), out=tmp_path / "store", workers=1, progress=False)
    return tmp_path / "store"


REFUSED = "not a regular file; outputs are written to a temporary file renamed into place, " \
          "which would replace it: name a regular file (for a link, its target)"


def test_export_to_a_link_writes_nothing_and_leaves_link_and_target_alone(store, tmp_path):
    (tmp_path / "target.bin").write_bytes(b"keep")
    (tmp_path / "link.bin").symlink_to("target.bin")
    r = tokenmill("export", store, "--format", "nanogpt", "--out", "link.bin", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"tokenmill export: error: link.bin: is a symbolic link to target.bin, {REFUSED}"]
    assert os.readlink(tmp_path / "link.bin") == "target.bin"
    assert (tmp_path / "target.bin").read_bytes() == b"keep"
    assert not list(tmp_path.glob(".link.bin.tmp-*"))


def test_export_to_a_dangling_link_creates_nothing(store, tmp_path):
    (tmp_path / "link.bin").symlink_to("missing/target.bin")
    r = tokenmill("export", store, "--format", "jsonl", "--out", "link.bin", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"tokenmill export: error: link.bin: is a symbolic link to missing/target.bin, {REFUSED}"]
    assert os.readlink(tmp_path / "link.bin") == "missing/target.bin"
    assert not (tmp_path / "missing").exists()


def test_export_to_a_fifo_is_refused_and_the_fifo_stays(store, tmp_path):
    os.mkfifo(tmp_path / "out.bin")
    r = tokenmill("export", store, "--format", "nanogpt", "--out", "out.bin", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"tokenmill export: error: out.bin: is a named pipe (FIFO), {REFUSED}"]
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out.bin").st_mode)


def test_every_atomic_writer_refuses_what_is_not_a_regular_file(tmp_path):
    """The one rule (io.atomic_output), for every writer: inspect --plot, bench --json/--plot,
    Watch(trace=), the demo, manifests and progress records. A regular file is replaced."""
    (tmp_path / "target").write_bytes(b"keep")
    (tmp_path / "link").symlink_to("target")
    (tmp_path / "dangling").symlink_to("nowhere")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        for name, what in [("link", "a symbolic link to target"),
                           ("dangling", "a symbolic link to nowhere"),
                           ("fifo", "a named pipe (FIFO)"), ("folder", "a directory"),
                           ("sock", "a socket")]:
            with pytest.raises(ConfigError, match=rf"^{tmp_path}/{name}: is {re.escape(what)}, "
                                                  "not a regular file"):
                atomic_write_bytes(tmp_path / name, b"new")
    assert os.readlink(tmp_path / "link") == "target" and not (tmp_path / "nowhere").exists()
    assert (tmp_path / "target").read_bytes() == b"keep"
    atomic_write_bytes(tmp_path / "target", b"new")
    assert (tmp_path / "target").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling", "fifo", "folder", "link", "sock", "target"]


def test_inspect_plot_to_a_link_is_refused(store, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "target.png").write_bytes(b"keep")
    (tmp_path / "plot.png").symlink_to("target.png")
    r = tokenmill("inspect", store, "--plot", "plot.png", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"tokenmill inspect: error: plot.png: is a symbolic link to target.png, {REFUSED}"]
    assert (tmp_path / "target.png").read_bytes() == b"keep"
